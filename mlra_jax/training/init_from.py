"""`--init_from=RUN_OR_HF_DIR`: a new run that starts from another run's weights, or from a Hugging Face
folder written by `convert to-hf` (config.json of model_type mlra with its safetensors).

Only the parameters are taken: the optimizer state is fresh, the step is 0 and the data starts at
its first example. The two model configs must agree (fields that only change how the model runs,
such as the attention implementation, may differ; a Hugging Face folder stores no dtypes, so those
are this run's). A Hugging Face folder is used only when complete (config, code, weights and tokenizer:
an export that stopped before its end is refused) and its config.json fields have their types.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mlra_jax.checkpoint import Checkpointer
from mlra_jax.config import RUNTIME_FIELDS, CheckpointConfig, ConfigError, ModelConfig
from mlra_jax.guards import check_finite
from mlra_jax.interop.files import ReferenceFileError, read_reference
from mlra_jax.interop.hf_folder import check_hf_folder, hf_fields, hf_step, model_config_from_hf, read_hf_config
from mlra_jax.interop.state_dict import StateDictError, from_state_dict
from mlra_jax.params import unflatten
from mlra_jax.paths import as_path
from mlra_jax.run_config import experiment_from_dict, read_run_config


def _hf_config(source: str | os.PathLike) -> dict[str, Any] | None:
    """The config.json of a local Hugging Face folder of ours (not a run directory), or None."""
    if "://" in str(source) or (Path(source) / "experiment.json").exists():
        return None
    return read_hf_config(Path(source))


def source_model(source: str | os.PathLike) -> ModelConfig:
    hf = _hf_config(source)
    if hf is not None:
        check_hf_folder(Path(source), f"--init_from={source}")
        return model_config_from_hf(hf, str(source))
    path = as_path(source) / "experiment.json"
    if not path.exists():
        raise ConfigError(
            f"--init_from={source} is neither a run directory (no experiment.json) nor a Hugging Face "
            f"folder of `convert to-hf` (config.json of model_type mlra)"
        )
    try:
        return experiment_from_dict(read_run_config(path)).model
    except TypeError as err:
        raise ConfigError(f"{path} does not describe an experiment of this version ({err})") from None


def check_same_model(source: str | os.PathLike, model: ModelConfig) -> None:
    """ConfigError naming every model field in which `model` differs from the source's."""
    theirs = source_model(source)
    fields = hf_fields(model) if _hf_config(source) is not None else dataclasses.asdict(model)
    source_fields = dataclasses.asdict(theirs)
    differ = [
        f"model.{k} is {source_fields[k]!r} there, {v!r} here"
        for k, v in fields.items()
        if k not in RUNTIME_FIELDS and source_fields.get(k) != v
    ]
    if differ:
        raise ConfigError(
            f"--init_from={source} holds another model: {'; '.join(differ)}. Train the same model "
            f"(e.g. --model.FIELD=VALUE as there)"
        )


def _hf_params(folder: str | os.PathLike, abstract_params: Any) -> tuple[Any, int]:
    hf = _hf_config(folder)
    check_hf_folder(Path(folder), f"--init_from={folder}")
    cfg, step = model_config_from_hf(hf, str(folder)), hf_step(hf, str(folder))
    try:
        tensors, _ = read_reference(Path(folder))
        flat = from_state_dict(tensors, cfg)  # validated: names, shapes, finite values
    except (ReferenceFileError, StateDictError) as err:
        raise ConfigError(f"--init_from={folder}: {err}") from None
    del tensors

    def place(array: np.ndarray, abstract: Any) -> jax.Array:  # each device (and host) takes its own slices
        array = array.astype(abstract.dtype)
        return jax.make_array_from_callback(array.shape, abstract.sharding, lambda index: array[index])

    return jax.tree.map(place, unflatten(flat), abstract_params), step


def source_params(source: str | os.PathLike, abstract_params: Any) -> tuple[Any, int]:
    """(params of the run's newest complete checkpoint or of the Hugging Face folder, in `abstract_params`'
    shardings, the step they were saved at)."""
    if _hf_config(source) is not None:
        return _hf_params(source, abstract_params)
    checkpointer = Checkpointer(as_path(source) / "checkpoints", CheckpointConfig(), read_only=True)
    try:
        restored = checkpointer.restore_latest({"params": abstract_params})
    finally:
        checkpointer.close()
    if restored is None:
        raise ConfigError(f"--init_from={source} holds no complete checkpoint")
    check_finite(
        restored[1]["params"],
        f"--init_from={source}, step {restored[0]}",
        fix="start from a run or folder whose weights are finite",
    )
    return restored[1]["params"], restored[0]
