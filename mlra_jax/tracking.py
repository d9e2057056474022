"""Weights & Biases tracking (--metrics.wandb_project): the records of metrics.jsonl, logged to a W&B run.

wandb is optional (`pip install -e '.[wandb]'`). The W&B run's id is kept in RUN/wandb_run_id, so a resumed
training run continues the same W&B run. `WANDB_MODE=offline` writes the run under RUN/wandb without a
network (`wandb sync RUN/wandb/offline-run-*` uploads it later); wandb's other variables work as usual.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import uuid
from typing import Any

from etils import epath

from mlra_jax.config import ConfigError, Experiment
from mlra_jax.paths import is_remote

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"


def check_available(experiment: Experiment) -> None:
    """A ConfigError, before anything is written, when W&B tracking is asked for but wandb is missing or has
    no credentials (online mode: `wandb login` or WANDB_API_KEY; a notebook asks for the key here)."""
    project = experiment.metrics.wandb_project
    if not project:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"--metrics.wandb_project={project} needs the wandb package: pip install -e '.[wandb]' "
            f"(or pip install wandb), or leave the option out"
        )
    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        return
    import wandb

    try:
        wandb.login(verify=False)
    except wandb.errors.UsageError as err:
        raise ConfigError(
            f"--metrics.wandb_project={project}: {err} Run `wandb login` or set WANDB_API_KEY, or "
            f"set WANDB_MODE=offline to log without a network (wandb sync uploads it later)"
        ) from None


class WandbTracker:
    """One W&B run per training run directory; `write` logs a record at its step."""

    def __init__(self, experiment: Experiment, workdir: epath.Path):
        import wandb

        cfg = experiment.metrics
        id_file = workdir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=cfg.wandb_name or experiment.name,
            id=run_id,
            resume="allow",
            config=dataclasses.asdict(experiment),
            dir=None if is_remote(workdir) else os.fspath(workdir),
        )
        if not id_file.exists():
            id_file.write_text(run_id + "\n")
        log.info(
            "logging to Weights & Biases: project %s, run %s (%s)", cfg.wandb_project, run_id, self.run.settings.mode
        )

    def write(self, step: int, values: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self.run.finish()
