"""Exclusive OS file locks (flock) that name their holder: the run lock and prepare's output lock.

The kernel releases a flock when its process ends however it ends, so a killed holder leaves no stale
lock; the file keeps the holder's host and pid for the message a second process gets.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO


def try_lock(path: Path) -> tuple[IO[str] | None, str]:
    """An exclusive lock on `path` (created if missing), not waited for: (the open handle that holds it, with
    this process's host and pid written in the file) or (None, what the file says of its holder, '' if
    nothing) when another process holds it. A file its holder removed as it finished is locked afresh."""
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            return None, holder
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(handle.fileno())
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        handle.close()  # its holder removed the file as it finished: lock the one there now
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
    handle.flush()
    return handle, ""
