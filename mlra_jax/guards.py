"""The one place that checks what a command is about to read or write, for every command.

* `atomic_write_text`, `atomic_write_bytes`: a file replaced whole or not at all (a temporary beside it, renamed
  over it), so a kill mid-write leaves the old content or the new, never a truncated file; a character device or
  a FIFO (/dev/null, /dev/stdout onto a pipe) is written through, never renamed over; `remove_stale_temporaries`:
  the temporaries a killed rewrite left; `follow_umask`: the modes a plain mkdir and open() give, for a folder
  that library code wrote 0700/0600.
* `check_writable_dir`: a folder that exists (or can be made) and takes a file, checked before any work;
  `check_run_dir`: a run directory whose own entries are what the run keeps there.
* `check_output_path`: an output that is not one of the command's inputs or a run's own files, whose folder
  can take it; `replaced` says when an earlier result is overwritten.
* `check_finite`: weights loaded for use (export, import, init_from, generate, eval) hold no NaN or inf; the
  error names the tensors and where they came from.
* `without_non_finite`: results with NaN and inf as null, for JSON (which has no NaN); `error_summary`: an
  error in one line.

Each check raises `InputError` (a ConfigError: the commands exit 2 with its message).
"""

from __future__ import annotations

import glob
import logging
import math
import os
import stat
import tempfile
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mlra_jax.config import ConfigError
from mlra_jax.params import flatten
from mlra_jax.paths import as_path, is_remote

log = logging.getLogger(__name__)

# A run directory's own files and folders, which no output of another command may replace
RUN_FILES = ("experiment.json", "metrics.jsonl", "lock", "checkpoints", "tensorboard", "profile")
TEMPORARY_SUFFIX = ".tmp"  # of the temporaries of atomic rewrites (.NAME.XXXXXXXX.tmp)


class InputError(ConfigError):
    """A path, a file or loaded weights that a command cannot use; the message names it and the fix."""


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` whole: locally a temporary file in the same folder, flushed to disk and renamed
    over `path` (readers see the old content or the new one); an object store's writes are whole already."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`atomic_write_text` for bytes. The file gets the mode a plain open() would give it: that of the file it
    replaces, else the umask's (not mkstemp's 0600, which would hide it from the colleagues who share the folder).
    A symbolic link keeps pointing where it did (its target is replaced); a character device or a FIFO is
    written through (never replaced); any other file that is not a regular one is refused (InputError)."""
    target = as_path(path)
    if is_remote(target):
        target.write_bytes(data)
        return
    local = os.fspath(target)
    if output_stream(local):
        with open(local, "wb") as f:
            f.write(data)
        return
    local = os.path.realpath(local) if os.path.islink(local) else local
    mode = os.stat(local).st_mode & 0o7777 if os.path.isfile(local) else 0o666 & ~current_umask()
    name = os.path.basename(local)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=TEMPORARY_SUFFIX, dir=os.path.dirname(local))
    try:
        with os.fdopen(descriptor, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(temporary, local)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def output_stream(path: str) -> bool:
    """Whether `path` (followed through links) is a character device or a FIFO, which an output is written through;
    False for a regular file or a missing one. Any other existing file that is not a folder (a block device, a
    socket) is an InputError: nothing may replace it."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return True
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "block device" if stat.S_ISBLK(mode) else "socket" if stat.S_ISSOCK(mode) else "special file"
        raise InputError(f"{path} is a {kind}, not a regular file; an output is never written there: give a file path")
    return False


def remove_stale_temporaries(folder: str | os.PathLike, names: Iterable[str]) -> list[str]:
    """Remove the temporaries that atomic rewrites of `names` in `folder` left when killed (.NAME.XXXXXXXX.tmp);
    only for a folder whose writer holds it (the run lock). Returns the removed names."""
    local = os.fspath(folder)
    removed = []
    for name in names:
        for temporary in glob.glob(os.path.join(glob.escape(local), f".{glob.escape(name)}.*{TEMPORARY_SUFFIX}")):
            if os.path.isfile(temporary) and not os.path.islink(temporary):
                os.unlink(temporary)
                removed.append(os.path.basename(temporary))
    return removed


def current_umask() -> int:
    """This process's umask: from /proc on Linux, else by setting it and back (no getter; a race with threads)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def follow_umask(folder: str | os.PathLike) -> None:
    """Give a folder written by library code (tempfile.mkdtemp: 0700; safetensors and others: 0600 files) and
    everything in it the modes that mkdir and open() give under the umask."""
    mask = current_umask()
    for root, _, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o111
                os.chmod(path, (0o777 if executable else 0o666) & ~mask)


def check_writable_dir(path: str | os.PathLike, what: str, make: bool = True) -> None:
    """`path` is (or can be made) a folder that takes new files; an InputError naming it and the fix otherwise.
    Object stores are not probed (their permissions show at the first write). `make=False` leaves a missing
    folder unmade (a command that may still fail leaves no trace): its nearest existing parent must take it."""
    folder = as_path(path)
    if is_remote(folder):
        return
    local = os.fspath(folder)
    blocker = _file_in_the_way(local)
    if blocker is not None:
        raise InputError(f"{what} {local} cannot be a folder: {blocker} is a file; use another path")
    if not make and not os.path.isdir(local):
        parent = os.path.abspath(local)
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise InputError(
                f"{what} {local} cannot be made: {parent} is not writable; fix its permissions or use another path"
            )
        return
    try:
        os.makedirs(local, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=local, prefix=".write-check-", delete=True)
        probe.close()
    except OSError as err:
        raise InputError(
            f"{what} {local} is not writable ({err.strerror}); fix its permissions or use another path"
        ) from None


# A run's own entries and what each must be
_RUN_ENTRIES = (
    ("experiment.json", "file"),
    ("metrics.jsonl", "file"),
    ("lock", "file"),
    ("checkpoints", "folder"),
    ("tensorboard", "folder"),
)


def check_run_dir(workdir: str | os.PathLike) -> None:
    """A run directory training can use, checked before anything is written or computed: a folder (made if
    missing) that takes new files, whose own entries are files and folders where the run keeps them, and whose
    checkpoints folder takes new files."""
    folder = as_path(workdir)
    if is_remote(folder):
        return
    check_writable_dir(folder, "the run directory")
    for name, kind in _RUN_ENTRIES:
        entry = os.path.join(os.fspath(folder), name)
        if os.path.exists(entry) and os.path.isdir(entry) != (kind == "folder"):
            raise InputError(
                f"{entry} is a {'folder' if kind == 'file' else 'file'}, where the run keeps its {name} "
                f"{kind}; move it out of the way"
            )
    checkpoints = os.path.join(os.fspath(folder), "checkpoints")
    if os.path.isdir(checkpoints):
        check_writable_dir(checkpoints, "the run's checkpoints folder")


def _file_in_the_way(path: str) -> str | None:
    """The file at `path` or at one of its parents, where a folder is needed; None when there is none."""
    current = os.path.abspath(path)
    while True:
        if os.path.exists(current) and not os.path.isdir(current):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def check_output_path(
    out: str | os.PathLike,
    inputs: Iterable[str | os.PathLike] = (),
    run_dirs: Iterable[str | os.PathLike] = (),
    kind: str = "file",
    make_folder: bool = True,
) -> bool:
    """Refuse an output (`kind` "file" or "folder") that would replace one of `inputs` or a run's own files
    (RUN_FILES of each of `run_dirs` and of any run directory above `out`), or whose folder cannot take it (made
    now unless `make_folder` is False: then the caller makes it when it writes). Returns whether an earlier output
    is replaced (the caller says so)."""
    target = _absolute(out)
    run_dirs = [*run_dirs, *([] if is_remote(target) else _runs_above(target))]
    for source in map(_absolute, inputs):
        inside = _under(target, source) and not is_remote(source) and os.path.isdir(source)
        if target == source or _under(source, target) or inside:
            raise InputError(
                f"--out {target} would {'write into' if inside else 'replace'} this command's input "
                f"{source}; write the result somewhere else"
            )
    for run in map(_absolute, run_dirs):
        for name in RUN_FILES:
            own = f"{run.rstrip('/')}/{name}"
            if target == own or _under(target, own) or _under(own, target):
                raise InputError(
                    f"--out {target} would replace the run's own {name} in {run}; write the result somewhere else"
                )
    if is_remote(target):
        return as_path(target).exists()
    if kind == "file" and output_stream(target):
        return False  # written through: a device or a pipe, no earlier result
    if os.path.isdir(target) if kind == "file" else (os.path.exists(target) and not os.path.isdir(target)):
        raise InputError(f"--out {target} is a {'folder' if kind == 'file' else 'file'}; give a {kind} path")
    check_writable_dir(os.path.dirname(target) or ".", "the folder of --out", make=make_folder)
    return os.path.exists(target)


def _runs_above(path: str) -> list[str]:
    """The run directories (folders holding experiment.json) that `path` is in: another run's files are no output
    either, whether or not the command reads that run."""
    runs, folder = [], os.path.dirname(path)
    while True:
        if os.path.isfile(os.path.join(folder, "experiment.json")):
            runs.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            return runs
        folder = parent


def _absolute(path: str | os.PathLike) -> str:
    return os.fspath(path) if is_remote(path) else os.path.abspath(os.fspath(path))


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def check_finite(
    tensors: Mapping[str, Any],
    source: str,
    fix: str = "take an earlier checkpoint (a run keeps checkpoint.keep of them) or the weights' original source",
) -> None:
    """An InputError naming every tensor of `tensors` (dotted name -> array, or a nested dict of them) that holds
    NaN or inf, and `source` (the checkpoint and step, or the file they came from). Device arrays are counted
    where they are; only the counts come to the host."""
    bad = []
    for name, value in flatten(tensors).items() if _nested(tensors) else tensors.items():
        dtype = getattr(value, "dtype", np.asarray(value).dtype)
        if not (np.issubdtype(dtype, np.floating) or str(dtype) == "bfloat16"):
            continue
        array = value if isinstance(value, jax.Array) else jnp.asarray(value)
        if bool(jnp.isfinite(array).all()):
            continue
        nan, inf = int(jnp.isnan(array).sum()), int(jnp.isinf(array).sum())
        bad.append(f"{name} ({nan} NaN, {inf} inf of {array.size})")
    if bad:
        shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise InputError(f"the weights of {source} are not finite: {shown}. They cannot be used; {fix}")


def _nested(tree: Mapping[str, Any]) -> bool:
    return any(isinstance(value, Mapping) for value in tree.values())


def error_summary(err: BaseException, limit: int = 200) -> str:
    """`TypeName: the first line of its message` (the type alone when the message is empty), for one-line errors."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:limit]}" if lines else type(err).__name__


def without_non_finite(value: Any) -> Any:
    """`value` (nested dicts, lists and tuples) with every NaN and inf float replaced by None: JSON has no NaN, and
    a bare NaN in a results file breaks the tools that read it (json.dumps(..., allow_nan=False) then guards it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: without_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_non_finite(v) for v in value]
    return value
