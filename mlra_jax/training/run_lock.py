"""One writer per run directory: an exclusive lock held by the training process for the whole run.

The lock is an OS file lock (flock, mlra_jax.file_lock) on `WORKDIR/lock`, which the kernel releases when the
process ends however it ends, so a killed run leaves no stale lock; the file keeps the
holder's host and pid for the message a second writer gets. Local and NFS-style folders only: an
object store (a gs:// workdir) has no locks, so there the lock is skipped with a warning.
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
    def __init__(self, workdir: str | os.PathLike):
        self.workdir = workdir
        self.path = None if is_remote(workdir) else local_path(workdir) / "lock"
        self._file = None

    def acquire(self) -> RunLock:
        if self.path is None:
            log.warning(
                "%s is on an object store, which has no file locks: training there is not guarded against a "
                "second job; running one job per workdir is your responsibility",
                self.workdir,
            )
            return self
        handle, holder = try_lock(self.path)
        if handle is None:
            raise ConfigError(
                f"{self.path.parent} is in use by another training process ({holder or 'an unknown process'}); "
                f"wait for it to finish or stop it, or use another --workdir"
            )
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
