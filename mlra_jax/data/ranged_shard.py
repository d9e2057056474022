"""A token shard on an object store (gs://...), read by byte range: a host fetches only the windows
of its own examples, never the whole file.

Reads go through epath, one open handle per thread and shard, since grain reads with several threads
and a file object's seek + read is not thread-safe. An fsspec file (gcsfs for gs://) is read with its
file system's `cat_file(path, start, end)`: one exact ranged request, without the read-ahead block
its buffered `read` would fetch.
"""

from __future__ import annotations

import threading
from typing import IO

import numpy as np
from etils import epath

TOKEN_BYTES = 2  # uint16


def read_range(handle: IO[bytes], start: int, end: int) -> bytes:
    """Bytes [start, end) of an open file (fewer at its end)."""
    fs = getattr(handle, "fs", None)
    if fs is not None and hasattr(fs, "cat_file"):  # fsspec: one ranged request, no read-ahead block
        return fs.cat_file(handle.path, start, end)
    handle.seek(start)
    return handle.read(end - start)


class RangedShard:
    """The tokens of one shard, like its memmap for what TokenWindows uses: `size` and `[start:stop]`."""

    def __init__(self, path: epath.Path, offset: int, count: int):
        self.path, self.offset, self.size = path, offset, count
        self._local = threading.local()

    def _handle(self) -> IO[bytes]:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            handle = self._local.handle = self.path.open("rb")
        return handle

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a RangedShard reads contiguous slices, not {index!r}")
        start, stop, _ = index.indices(self.size)
        if stop <= start:
            return np.zeros(0, np.uint16)
        data = read_range(self._handle(), self.offset + start * TOKEN_BYTES, self.offset + stop * TOKEN_BYTES)
        if len(data) != (stop - start) * TOKEN_BYTES:
            raise OSError(
                f"{self.path}: read {len(data)} bytes at token {start}, expected "
                f"{(stop - start) * TOKEN_BYTES}; the file changed while training"
            )
        return np.frombuffer(data, dtype=np.uint16)

    def __getstate__(self) -> dict:  # open handles stay with the process (grain may pickle sources)
        return {"path": self.path, "offset": self.offset, "size": self.size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["offset"], state["size"])

    def __repr__(self) -> str:
        return f"RangedShard({self.path}, {self.size} tokens)"
