"""A run's recorded configuration: the sections of an Experiment and its experiment.json, read back.

Library code (resume checks, --init_from, generate) reads runs through this module, never through the
command-line module `cli`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlra_jax.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    Experiment,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    ProfileConfig,
    TrainConfig,
)

# What experiment.json records besides the Experiment: the training data's fingerprint (data.pipeline.data_fingerprint)
FINGERPRINT = "data_fingerprint"

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "profile": ProfileConfig,
}


def experiment_from_dict(data: dict[str, Any]) -> Experiment:
    """An Experiment from its dataclasses.asdict form (a run's experiment.json)."""
    sections = {name: cls(**data[name]) for name, cls in SECTIONS.items() if name in data}
    rest = {k: v for k, v in data.items() if k not in SECTIONS and k != FINGERPRINT}
    return Experiment(**rest, **sections)


def read_run_config(path: Path) -> dict[str, Any]:
    """A run's experiment.json as a dict, or a ConfigError that names the file when it is not one."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise ValueError("no 'model' section")
        return data
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(
            f"{path} is not a run's experiment.json ({type(err).__name__}: {err}); it records the "
            f"configuration the run was trained with: restore it, or use another --workdir"
        ) from None


def run_experiment(run_dir: Any) -> Experiment:
    """The Experiment a run directory (a Path or an epath.Path) recorded in its experiment.json; a ConfigError
    naming the fix when it is not a run or records fields this version does not know."""
    config_path = run_dir / "experiment.json"
    if not config_path.exists():
        raise ConfigError(
            f"{run_dir} is not a run directory (no experiment.json); pass the --workdir of a training run"
        )
    try:
        return experiment_from_dict(read_run_config(config_path))
    except TypeError as err:  # fields this version does not know
        raise ConfigError(f"{config_path} does not describe an experiment of this version ({err})") from None
