"""`--init_from=RUN`: a new run that starts from another run's weights (e.g. converted ones).

Only the parameters are taken: the optimizer state is fresh, the step is 0 and the data starts at
its first example. The two runs' model configs must agree (fields that only change how the model
runs, such as the attention implementation, may differ).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mlra_jax.checkpoint import Checkpointer
from mlra_jax.cli import experiment_from_dict, read_run_config
from mlra_jax.config import RUNTIME_FIELDS, CheckpointConfig, ConfigError, ModelConfig
from mlra_jax.paths import as_path


def source_model(run_dir: str | os.PathLike) -> ModelConfig:
    path = as_path(run_dir) / "experiment.json"
    if not path.exists():
        raise ConfigError(f"--init_from={run_dir} is not a run directory (no experiment.json)")
    try:
        return experiment_from_dict(read_run_config(path)).model
    except TypeError as err:
        raise ConfigError(f"{path} does not describe an experiment of this version ({err})") from None


def check_same_model(run_dir: str | os.PathLike, model: ModelConfig) -> None:
    """ConfigError naming every model field in which `model` differs from the run's."""
    source = dataclasses.asdict(source_model(run_dir))
    differ = [f"model.{k} is {source[k]!r} there, {v!r} here" for k, v in dataclasses.asdict(model).items()
              if k not in RUNTIME_FIELDS and source.get(k) != v]
    if differ:
        raise ConfigError(f"--init_from={run_dir} holds another model: {'; '.join(differ)}. Train the same model "
                          f"(e.g. --model.FIELD=VALUE as there)")


def source_params(run_dir: str | os.PathLike, abstract_params: Any) -> tuple[Any, int]:
    """(params of the run's newest complete checkpoint, restored into `abstract_params`' shardings, its step)."""
    checkpointer = Checkpointer(as_path(run_dir) / "checkpoints", CheckpointConfig(), read_only=True)
    try:
        restored = checkpointer.restore_latest({"params": abstract_params})
    finally:
        checkpointer.close()
    if restored is None:
        raise ConfigError(f"--init_from={run_dir} holds no complete checkpoint")
    return restored[1]["params"], restored[0]
