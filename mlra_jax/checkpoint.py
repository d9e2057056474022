"""Orbax checkpoints: the training state and its JSON metadata, saved together.

The state (params, optimizer state, FP8 amax histories where kept, RNG) is a pytree saved asynchronously; orbax
writes each step into a temporary folder and renames it when complete, so a step
folder is either whole or absent. Restoring takes target shardings, so a checkpoint
restores onto any mesh or device count. A step that fails to restore is skipped for the
previous one, and set aside once an older step restores; when none restores, nothing is
touched and the caller gets a CheckpointError.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from etils import epath

from mlra_jax.config import CheckpointConfig
from mlra_jax.guards import error_summary
from mlra_jax.paths import as_path

log = logging.getLogger(__name__)


# Top-level state entries that a checkpoint may lack: the FP8 amax histories (a run resumed with
# model.matmul_dtype=float8 from checkpoints saved without them starts them fresh).
OPTIONAL_ENTRIES = ("fp8",)


def saved_metadata(state_dir: epath.Path) -> Any:
    """The saved state's tree of array metadata (shapes, dtypes) by top-level entry (the handler's thread is closed
    after)."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return handler.metadata(state_dir)
    finally:
        handler.close()


def params_mismatch(saved: Any, wanted: Any) -> str | None:
    """How the saved parameters differ from the wanted ones in names or shapes (another model), or None. Checked
    before Orbax reads any array: a failed read leaves its pending reads to fail later, outside any caller."""
    shapes = {jax.tree_util.keystr(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
    wanted_shapes = {
        jax.tree_util.keystr(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(wanted)[0]
    }
    if set(shapes) != set(wanted_shapes):
        absent, extra = sorted(set(wanted_shapes) - set(shapes)), sorted(set(shapes) - set(wanted_shapes))
        return f"the saved parameters differ from the model's (not saved: {absent[:3]}; not in the model: {extra[:3]})"
    for name, shape in wanted_shapes.items():
        if shapes[name] != shape:
            return f"params{name} is saved with shape {shapes[name]}, the model's is {shape}"
    return None


class CheckpointError(RuntimeError):
    """Checkpoints exist but none restores; nothing in the run was changed."""


class Checkpointer:
    """Orbax checkpoints of one run; `read_only` (generation, inspection) never writes, renames or creates."""

    def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig, read_only: bool = False):
        self.directory = as_path(directory)  # a local folder (absolute) or a URL: orbax writes both
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(  # read-only: none of the writing options (Orbax warns of each)
            max_to_keep=None if read_only else cfg.keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=cfg.async_save,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Start saving (returns before the write finishes when async); `wait` to block. Empty entries of the
        state (no FP8 histories) are not written."""
        state = {name: tree for name, tree in state.items() if jax.tree.leaves(tree)}
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata)),
            force=True,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_step(self, step: int, abstract_state: dict[str, Any]) -> tuple[int, Any, dict[str, Any]]:
        """`abstract_state` may hold only some top-level entries ({"params": ...} for serving): only those
        are read. Of them, an OPTIONAL entry that the checkpoint lacks (FP8 histories saved by a run without
        them) is left out of the restored state, for the caller to make fresh; any other is an error."""
        metadata = saved_metadata(self.directory / str(step) / "state")
        saved = set(metadata)
        missing = sorted(set(abstract_state) - saved - set(OPTIONAL_ENTRIES))
        if missing:
            raise ValueError(f"the checkpoint holds {sorted(saved)}, not {missing}")
        mismatch = params_mismatch(metadata["params"], abstract_state["params"]) if "params" in abstract_state else None
        if mismatch:
            raise ValueError(mismatch)
        wanted = {name: tree for name, tree in abstract_state.items() if name in saved}
        if set(wanted) == saved:
            state_args = ocp.args.StandardRestore(wanted)
        else:
            state_args = ocp.args.PyTreeRestore(
                item=wanted,
                partial_restore=True,
                restore_args=ocp.checkpoint_utils.construct_restore_args(wanted),
            )
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=state_args, metadata=ocp.args.JsonRestore())
        )
        return step, restored["state"], restored["metadata"]

    def restore_latest(
        self,
        abstract_state: Any,
        required_metadata: tuple[str, ...] = (),
        validate: Callable[[int, Any], None] | None = None,
    ) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, metadata) of the newest checkpoint that restores, or None if there is none.

        `abstract_state` holds jax.ShapeDtypeStructs with the target shardings; metadata that lacks a key
        of `required_metadata`, or a state that `validate(step, state)` raises on (weights that are not
        finite), fails the step like unreadable bytes. Newer steps that fail
        are set aside (renamed `STEP.damaged`) only once an older one restores, which shows the fault is
        theirs; a read-only checkpointer only skips them. When every step fails (a changed model, an
        unreadable folder, too little memory) nothing is touched and CheckpointError says why."""
        failures: list[tuple[int, Exception]] = []
        for step in reversed(self.steps()):
            try:
                restored = self.restore_step(step, abstract_state)
                missing = [k for k in required_metadata if not isinstance(restored[2], dict) or k not in restored[2]]
                if missing:
                    raise ValueError(f"its metadata lacks {', '.join(missing)}")
                if validate is not None:
                    validate(step, restored[1])
            except Exception as err:  # noqa: BLE001 - judged below, once an older step restores or none does
                failures.append((step, err))
                continue
            for failed, err in failures:
                what = "skipped it" if self.read_only else f"moved it to {self._set_aside(failed)}"
                log.warning(
                    "checkpoint %s/%d is incomplete or damaged (%s); %s and restored step %d",
                    self.directory,
                    failed,
                    error_summary(err, 200),
                    what,
                    step,
                )
            return restored
        if failures:
            step, err = failures[0]
            raise CheckpointError(
                f"none of the {len(failures)} checkpoints in {self.directory} restores; the newest, step {step}, "
                f"fails with {error_summary(err, 300)}. Nothing was changed. If the "
                f"model or mesh changed, run with the configuration the checkpoints were saved with; to start over, "
                f"use another --workdir"
            )
        return None

    def _set_aside(self, step: int) -> epath.Path:
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
