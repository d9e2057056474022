"""Orbax checkpoints: the training state and its JSON metadata, saved together.

The state (params, optimizer state, FP8 amax histories where kept, RNG) is a pytree saved asynchronously; orbax
writes each step into a temporary folder and renames it when complete, so a step
folder is either whole or absent. Restoring takes target shardings, so a checkpoint
restores onto any mesh or device count. A step that fails to restore is skipped for the
previous one, and set aside once an older step restores; when none restores, nothing is
touched and the caller gets a CheckpointError.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from etils import epath

from mlra_jax.config import CheckpointConfig
from mlra_jax.guards import error_summary
from mlra_jax.paths import as_path

log = logging.getLogger(__name__)


# Top-level state entries that are disposable: the FP8 amax histories. A checkpoint that lacks them (saved with
# another model.matmul_dtype or fp8_scaling), or where the run now keeps none, restores without them; one that
# holds them in another layout (another history length, other sites) restores those of the same path and shape
# (a state saved before the attention cores had histories: its projections'): the caller starts the rest fresh.
OPTIONAL_ENTRIES = ("fp8",)


def saved_layout(state_dir: epath.Path) -> dict[str, dict[tuple[str, ...], tuple[int, ...]]]:
    """The top-level entries of a saved state, each as {leaf path: shape}, from its metadata (the handler's thread
    is closed after)."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(state_dir)
        return {name: _layout(tree) for name, tree in dict(metadata).items()}
    finally:
        handler.close()


def _layout(tree: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(str(getattr(k, "key", k)) for k in path): tuple(getattr(leaf, "shape", ())) for path, leaf in leaves}


def _matching(tree: dict[str, Any], saved: dict[tuple[str, ...], tuple[int, ...]], prefix: tuple = ()) -> dict:
    """The nested dict `tree` (of arrays or ShapeDtypeStructs) with only the leaves that `saved` ({leaf path:
    shape}) holds at the same path with the same shape."""
    kept = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict):
            if inner := _matching(value, saved, path):
                kept[key] = inner
        elif saved.get(path) == tuple(value.shape):
            kept[key] = value
    return kept


def params_mismatch(
    saved: dict[tuple[str, ...], tuple[int, ...]], wanted: dict[tuple[str, ...], tuple[int, ...]]
) -> str | None:
    """How saved parameters ({leaf path: shape}) differ from the model's in names or shapes (another model), or
    None: checked before Orbax reads any array."""
    if set(saved) != set(wanted):
        absent, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        named = lambda paths: ["/".join(p) for p in paths[:3]]
        return (
            f"the saved parameters differ from the model's (not saved: {named(absent)}; not in the model: "
            f"{named(extra)})"
        )
    for path, shape in wanted.items():
        if saved[path] != shape:
            return f"params/{'/'.join(path)} is saved with shape {saved[path]}, the model's is {shape}"
    return None


def _abandoned_read(unraisable: Any) -> bool:
    """Whether an unraisable exception is the echo of an Orbax read abandoned when a restore failed: Orbax stops at
    the first array that fails and closes its event loop while TensorStore still completes the other reads, each
    of which then reports "Event loop is closed"; their coroutines, collected later, raise the read error again."""
    error, origin = unraisable.exc_value, unraisable.object
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    return asyncio.iscoroutine(origin) and "orbax" in getattr(getattr(origin, "cr_code", None), "co_filename", "")


class _AbandonedTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records of Orbax's read tasks (an abandoned read's
    task, collected after its restore failed), counting them in `echoes`."""

    def __init__(self, echoes: list[None]):
        super().__init__()
        self.echoes = echoes

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Task exception was never retrieved") and "orbax" in message:
            self.echoes.append(None)
            return False
        return True


@contextlib.contextmanager
def _quiet_abandoned_reads(failures: list[tuple[int, Exception]]) -> Iterator[None]:
    """Within it, the echoes of abandoned reads are dropped: unraisable exceptions (_abandoned_read) and asyncio's
    records of their tasks (_AbandonedTasks), so that each failed restore is reported once, by restore_latest. On
    leaving after a failure, the errors in `failures` (reported by then) drop their tracebacks, which hold the
    abandoned reads, and those are collected once none has echoed for 50 ms (at most 2 s), while echoes are still
    dropped, not later in the run or at exit. Every other unraisable exception and asyncio record is shown as
    before."""
    previous, echoes = sys.unraisablehook, []
    tasks = _AbandonedTasks(echoes)

    def hook(unraisable: Any) -> None:
        if _abandoned_read(unraisable):
            echoes.append(None)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(tasks)
    try:
        yield
    finally:
        if failures:
            for _, err in failures:
                _drop_tracebacks(err)
            deadline, seen = time.monotonic() + 2, -1
            while len(echoes) != seen and time.monotonic() < deadline:
                seen = len(echoes)
                time.sleep(0.05)  # TensorStore completes the reads in flight
                gc.collect()
        logging.getLogger("asyncio").removeFilter(tasks)
        sys.unraisablehook = previous


def _failure(err: BaseException, limit: int) -> str:
    """error_summary of a failed restore; of an Orbax read error, its cause's (TensorStore's own text: Orbax's ends
    in the whole store spec)."""
    if "See full TensorStore details" in str(err) and err.__cause__ is not None:
        return error_summary(err.__cause__, limit)
    return error_summary(err, limit)


def _drop_tracebacks(err: BaseException | None) -> None:
    while err is not None:
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


@contextlib.contextmanager
def _without_warning(prefix: str) -> Iterator[None]:
    """absl's records that start with `prefix` are dropped inside the block (the logger is left as it was)."""

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(prefix)

    absl = logging.getLogger("absl")
    absl.addFilter(keep)
    try:
        yield
    finally:
        absl.removeFilter(keep)


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
        with _without_warning("Given directory is read only"):  # Orbax's note that read_only was asked for
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
        are read. Of them, an OPTIONAL entry that the checkpoint lacks is left out of the restored state; one it
        holds in another layout than `abstract_state`'s (FP8 histories of another length or of other sites, or
        where the run keeps none now) holds only the arrays saved at the same path with the same shape, or is left
        out where none is (logged): the caller makes the rest fresh. A missing entry of another kind is an error."""
        saved = saved_layout(self.directory / str(step) / "state")
        missing = sorted(set(abstract_state) - set(saved) - set(OPTIONAL_ENTRIES))
        if missing:
            raise ValueError(f"the checkpoint holds {sorted(saved)}, not {missing}")
        both = "params" in abstract_state and "params" in saved
        mismatch = params_mismatch(saved["params"], _layout(abstract_state["params"])) if both else None
        if mismatch:  # another model: refused before Orbax starts reading arrays
            raise ValueError(mismatch)
        wanted, dropped, partial = {}, [], []
        for name, tree in abstract_state.items():
            if name not in saved:
                continue
            if name in OPTIONAL_ENTRIES and _layout(tree) != saved[name]:
                kept = _matching(tree, saved[name]) if isinstance(tree, dict) else {}
                (partial if kept else dropped).append(name)
                if kept:
                    wanted[name] = kept
                continue
            wanted[name] = tree
        if set(wanted) == set(saved) and not partial:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(wanted), metadata=ocp.args.JsonRestore())
            )
        else:  # some entries: by a handler of its own (the manager's "state" item keeps StandardSave's handler)
            restored = {
                "metadata": self.manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))[
                    "metadata"
                ]
            }
            handler = ocp.PyTreeCheckpointHandler()
            try:
                restored["state"] = handler.restore(
                    self.directory / str(step) / "state",
                    args=ocp.args.PyTreeRestore(
                        item=wanted,
                        partial_restore=True,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(wanted),
                    ),
                )
            finally:
                handler.close()
        for name in partial:
            log.info(
                "checkpoint %d holds %s of another layout than this run keeps (%d arrays, now %d): restored the %d "
                "of the same path and shape; the others start fresh",
                step,
                name,
                len(saved[name]),
                len(_layout(abstract_state[name])),
                len(_layout(wanted[name])),
            )
        for name in dropped:
            log.info(
                "checkpoint %d holds %s of another layout than this run keeps (%d arrays, now %d; a changed "
                "model.matmul_dtype, model.fp8_scaling or history length): restored without them",
                step,
                name,
                len(saved[name]),
                len(_layout(abstract_state[name])),
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
        with _quiet_abandoned_reads(failures):
            return self._restore_newest(abstract_state, required_metadata, validate, failures)

    def _restore_newest(
        self,
        abstract_state: Any,
        required_metadata: tuple[str, ...],
        validate: Callable[[int, Any], None] | None,
        failures: list[tuple[int, Exception]],
    ) -> tuple[int, Any, dict[str, Any]] | None:
        """restore_latest's work; the steps that fail are appended to `failures`."""
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
                    _failure(err, 200),
                    what,
                    step,
                )
            return restored
        if failures:
            step, err = failures[0]
            raise CheckpointError(
                f"none of the {len(failures)} checkpoints in {self.directory} restores; the newest, step {step}, "
                f"fails with {_failure(err, 300)}. Nothing was changed. If the "
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
