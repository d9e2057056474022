"""Whether a run directory may be resumed with the experiment given now.

A run records its configuration in experiment.json. Resuming with another model is refused
(the checkpoints hold other weights). A change to the data order or the optimization
schedule is refused once checkpoints exist, unless `--allow_changed` names the field, since
the resumed run would silently differ from the one started. Other changes (logging,
evaluation, micro-batching, the mesh, how attention runs) are allowed and logged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from etils import epath

from mlra_jax.config import RUNTIME_FIELDS, ConfigError, Experiment
from mlra_jax.guards import atomic_write_text
from mlra_jax.run_config import SECTIONS, read_run_config

log = logging.getLogger(__name__)

# Fields whose change alters which examples a resumed run sees or the steps it takes with them.
TRAJECTORY_FIELDS = (
    "train.seq_len",
    "train.global_batch_size",
    "train.total_steps",
    "train.warmup_steps",
    "train.peak_lr",
    "train.min_lr_ratio",
    "train.beta1",
    "train.beta2",
    "train.eps",
    "train.weight_decay",
    "train.grad_clip",
    "train.seed",
    "data.dataset",
    "data.train_pattern",
)


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{field}": value for section in SECTIONS for field, value in config.get(section, {}).items()}


def validate_allowed(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in TRAJECTORY_FIELDS]
    if unknown:
        raise ConfigError(
            f"--allow_changed names {', '.join(unknown)}, which need no permission or do not exist; "
            f"it takes a comma-separated list of: {', '.join(TRAJECTORY_FIELDS)}"
        )


def check_resume(
    workdir: epath.Path, experiment: Experiment, has_checkpoints: bool, allow_changed: tuple[str, ...] = ()
) -> None:
    """Raise ConfigError if `experiment` may not continue the run in `workdir`. Writes nothing: the trainer
    records the experiment (record_experiment) only once the run has started from its checkpoints or from
    fresh weights, so that experiment.json keeps describing the checkpoints whatever fails before."""
    validate_allowed(allow_changed)
    path = workdir / "experiment.json"
    current = dataclasses.asdict(experiment)
    if path.exists():
        saved, now = _flatten(read_run_config(path)), _flatten(current)
        changed = {
            k: (saved.get(k), v) for k, v in now.items() if (k in saved or k.startswith("model.")) and saved.get(k) != v
        }
        model = [k for k in changed if k.startswith("model.") and k.split(".", 1)[1] not in RUNTIME_FIELDS]
        if model:
            detail = ", ".join(f"{k} was {changed[k][0]!r}, now {changed[k][1]!r}" for k in model)
            raise ConfigError(f"{workdir} holds a run of a different model ({detail}); use another --workdir")
        refused = [k for k in changed if k in TRAJECTORY_FIELDS and k not in allow_changed] if has_checkpoints else []
        if refused:
            detail = ", ".join(f"{k} was {changed[k][0]!r}, now {changed[k][1]!r}" for k in refused)
            raise ConfigError(
                f"{workdir} was trained with other settings ({detail}); resuming would change the data "
                f"order or the schedule of the run. Pass --allow_changed={','.join(refused)} to resume "
                f"with them anyway (the run continues at the same example), or use another --workdir"
            )
        for key, (old, new) in changed.items():
            log.warning("resuming %s with %s changed from %r to %r", workdir, key, old, new)


def record_experiment(workdir: epath.Path, experiment: Experiment) -> None:
    """Write the run's experiment.json, whole or not at all (guards.atomic_write_text)."""
    atomic_write_text(workdir / "experiment.json", json.dumps(dataclasses.asdict(experiment), indent=1))
