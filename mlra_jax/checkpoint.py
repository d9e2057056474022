"""Orbax checkpoints: the training state and its JSON metadata, saved together.

The state (params, optimizer state, RNG) is a pytree saved asynchronously; orbax
writes each step into a temporary folder and renames it when complete, so a step
folder is either whole or absent. Restoring takes target shardings, so a checkpoint
restores onto any mesh or device count. A step that fails to restore (a partial or
damaged folder) is skipped with a warning and the previous one is tried.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from mlra_jax.config import CheckpointConfig

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, metadata: dict[str, Any]) -> None:
        """Start saving (returns before the write finishes when async); `wait` to block."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        metadata=ocp.args.JsonSave(metadata)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_step(self, step: int, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), metadata=ocp.args.JsonRestore()))
        return step, restored["state"], restored["metadata"]

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, metadata) of the newest checkpoint that restores, or None if there is none.

        `abstract_state` holds jax.ShapeDtypeStructs with the target shardings."""
        for step in reversed(self.steps()):
            try:
                return self.restore_step(step, abstract_state)
            except Exception as err:  # noqa: BLE001 - any failure means this step is unusable
                aside = self._set_aside(step)
                log.warning("checkpoint %s/%d is incomplete or damaged (%s: %s); moved it to %s and trying the "
                            "previous one", self.directory, step, type(err).__name__,
                            str(err).splitlines()[0][:200], aside)
                continue
        return None

    def _set_aside(self, step: int) -> Path:
        """Rename a damaged step out of orbax's way (kept for inspection, never deleted)."""
        aside = self.directory / f"{step}.damaged"
        suffix = 0
        while aside.exists():
            suffix += 1
            aside = self.directory / f"{step}.damaged{suffix}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(aside)
        self.manager.reload()
        return aside

    def reached_preemption(self, step: int) -> bool:
        """True when the cluster announced a preemption that all hosts agree on (TPU/GPU schedulers)."""
        return self.manager.reached_preemption(step)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
