"""One writer per run directory: an exclusive lock held by the training process for the whole run.

The lock is an OS file lock (flock) on the run directory itself and on `WORKDIR/lock` (mlra_jax.file_lock), which
the kernel releases when the process ends however it ends, so a killed run leaves no stale lock. The folder's lock
is what excludes a second writer: deleting the lock file does not remove it. The file keeps the holder's host and
pid for the message a second writer gets. Local and NFS-style folders only: an object store (a gs:// workdir) has
no locks, so there the lock is skipped with a warning (and so is the folder's lock where a file system has none
for folders).
"""

from __future__ import annotations

import fcntl
import logging
import os

from mlra_jax.config import ConfigError
from mlra_jax.file_lock import try_lock
from mlra_jax.paths import is_remote, local_path

log = logging.getLogger(__name__)


class RunLock:
    """The run's lock; `release(started=False)` (a start refused before the run began) removes the lock file that
    this start made, so that a refused start leaves a new folder as it found it."""

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = workdir
        self.path = None if is_remote(workdir) else local_path(workdir) / "lock"
        self._file = None
        self._folder: int | None = None
        self._made_file = False

    def acquire(self) -> RunLock:
        if self.path is None:
            log.warning(
                "%s is on an object store, which has no file locks: training there is not guarded against a "
                "second job; running one job per workdir is your responsibility",
                self.workdir,
            )
            return self
        try:
            self._folder = _lock_folder(self.path.parent)
        except BlockingIOError:
            raise self._in_use(_holder(self.path)) from None
        self._made_file = not self.path.exists()
        handle, holder = try_lock(self.path)
        if handle is None:
            self._release_folder()
            raise self._in_use(holder)
        self._file = handle
        return self

    def _in_use(self, holder: str) -> ConfigError:
        return ConfigError(
            f"{self.path.parent} is in use by another training process ({holder or 'an unknown process'}); "
            f"wait for it to finish or stop it, or use another --workdir"
        )

    def release(self, started: bool = True) -> None:
        """Unlock; a start that did not begin (`started` False) removes the lock file it made."""
        if self._file is not None:
            if not started and self._made_file:
                self.path.unlink(missing_ok=True)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        self._release_folder()

    def _release_folder(self) -> None:
        if self._folder is not None:
            os.close(self._folder)  # closing the descriptor releases its flock
            self._folder = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_folder(folder: os.PathLike) -> int | None:
    """An open descriptor of `folder` holding an exclusive flock; None where the file system locks no folders;
    BlockingIOError when another process holds it."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise
    except OSError:  # no flock on folders here (some network file systems): the lock file alone guards the run
        os.close(descriptor)
        return None
    return descriptor


def _holder(path: os.PathLike) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
