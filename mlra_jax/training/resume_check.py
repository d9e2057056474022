"""Whether a run directory may be resumed with the experiment given now.

A run records its configuration in experiment.json, with the fingerprint of its training data. Resuming with
another model is refused (the checkpoints hold other weights). A change to the data order or the optimization
schedule, or other training data under the same path (the fingerprint differs), is refused once checkpoints exist,
unless `--allow_changed` names the field (data.dataset for the data), since the resumed run would silently differ
from the one started. Other changes (logging, evaluation, micro-batching, the mesh, how attention runs) are allowed
and logged. A folder without a checkpoint (a run that failed before its first save) takes any new settings.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from etils import epath

from mlra_jax.config import RUNTIME_FIELDS, ConfigError, Experiment
from mlra_jax.guards import atomic_write_text
from mlra_jax.run_config import FINGERPRINT, SECTIONS, read_run_config

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
    workdir: epath.Path,
    experiment: Experiment,
    has_checkpoints: bool,
    allow_changed: tuple[str, ...] = (),
    fingerprint: str | None = None,
) -> None:
    """Raise ConfigError if `experiment` (on training data of `fingerprint`, data.pipeline.data_fingerprint) may not
    continue the run in `workdir`. Writes nothing: the trainer records the experiment (record_experiment) only once
    the run has started from its checkpoints or from fresh weights, so that experiment.json keeps describing the
    checkpoints whatever fails before."""
    validate_allowed(allow_changed)
    path = workdir / "experiment.json"
    current = dataclasses.asdict(experiment)
    if not path.exists():
        return
    record = read_run_config(path)
    saved, now = _flatten(record), _flatten(current)
    changed = {
        k: (saved.get(k), v) for k, v in now.items() if (k in saved or k.startswith("model.")) and saved.get(k) != v
    }
    if not has_checkpoints:
        if changed:
            log.warning(
                "%s has no checkpoint: the run starts afresh with the settings given now (%s differ from its "
                "experiment.json)",
                workdir,
                ", ".join(changed),
            )
        return
    model = [k for k in changed if k.startswith("model.") and k.split(".", 1)[1] not in RUNTIME_FIELDS]
    if model:
        detail = ", ".join(f"{k} was {changed[k][0]!r}, now {changed[k][1]!r}" for k in model)
        raise ConfigError(f"{workdir} holds a run of a different model ({detail}); use another --workdir")
    refused = [k for k in changed if k in TRAJECTORY_FIELDS and k not in allow_changed]
    if refused:
        detail = ", ".join(f"{k} was {changed[k][0]!r}, now {changed[k][1]!r}" for k in refused)
        raise ConfigError(
            f"{workdir} was trained with other settings ({detail}); resuming would change the data "
            f"order or the schedule of the run. Pass --allow_changed={','.join(refused)} to resume "
            f"with them anyway (the run continues at the same example), or use another --workdir"
        )
    recorded = record.get(FINGERPRINT)
    if fingerprint and recorded and recorded != fingerprint and "data.dataset" not in allow_changed:
        raise ConfigError(
            f"the training data in {experiment.data.dataset} changed since {workdir} was trained on it (its "
            f"shards' names, sizes or recorded sha256 differ: fingerprint {recorded}, now {fingerprint}); resuming "
            f"would train on other data. Pass --allow_changed=data.dataset to resume on it anyway, or use another "
            f"--workdir"
        )
    for key, (old, new) in changed.items():
        log.warning("resuming %s with %s changed from %r to %r", workdir, key, old, new)


def record_experiment(workdir: epath.Path, experiment: Experiment, fingerprint: str | None = None) -> None:
    """Write the run's experiment.json (with the training data's `fingerprint` when given), whole or not at all
    (guards.atomic_write_text)."""
    record = dataclasses.asdict(experiment)
    if fingerprint:
        record[FINGERPRINT] = fingerprint
    atomic_write_text(workdir / "experiment.json", json.dumps(record, indent=1))
