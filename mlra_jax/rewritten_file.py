"""Files on object stores, which have no append: the whole content is kept in memory and written
again (one upload) at most every `interval_s` seconds, and at once on `flush(force=True)` and `close`.

metrics.jsonl and the TensorBoard event files of a gs:// run are written this way (a run's metrics
are small: about 200 bytes a logged step); local files are appended to as usual.
"""

from __future__ import annotations

import threading
import time

from etils import epath

REWRITE_EVERY_S = 30.0


class RewrittenFile:
    """A binary file whose content is rewritten whole; `write` only appends to memory."""

    def __init__(self, path: epath.Path, content: bytes = b"", interval_s: float = REWRITE_EVERY_S):
        self.path, self.interval_s = path, interval_s
        self._content = bytearray(content)
        self._dirty, self._written_at, self._lock = False, -float("inf"), threading.Lock()

    def write(self, data: bytes) -> int:
        with self._lock:
            self._content += data
            self._dirty = True
        return len(data)

    def replace_content(self, content: bytes) -> None:
        with self._lock:
            self._content = bytearray(content)
            self._dirty = True

    def flush(self, force: bool = False) -> None:
        """Upload the content if it changed and `interval_s` passed since the last upload (or `force`)."""
        with self._lock:
            if not self._dirty or (not force and time.monotonic() - self._written_at < self.interval_s):
                return
            self.path.write_bytes(bytes(self._content))
            self._dirty, self._written_at = False, time.monotonic()

    def close(self) -> None:
        self.flush(force=True)


class RewrittenFileFactory:
    """tensorboardX's writer factory (`tensorboardX.record_writer.register_writer_factory`) for URLs:
    event files through epath (gcsfs for gs://) instead of tensorboardX's google-cloud-storage writer."""

    def __init__(self, interval_s: float = REWRITE_EVERY_S):
        self.interval_s = interval_s
        self.files: list[RewrittenFile] = []

    def directory_check(self, path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)

    def open(self, path: str) -> RewrittenFile:
        file = RewrittenFile(epath.Path(path), interval_s=self.interval_s)
        self.files.append(file)
        return file

    def flush_all(self) -> None:
        for file in self.files:
            file.flush(force=True)
