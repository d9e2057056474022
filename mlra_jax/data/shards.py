"""llm.c token shards: a 256 x int32 header (magic 20240520, version 1, token count),
then the tokens as uint16. The official preprocessed data and llm.c's FineWeb scripts
write this format. Local shards are memory-mapped; shards on an object store (gs://) are read by
byte range (ranged_shard.py), after the same header checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from etils import epath

from mlra_jax.data.ranged_shard import RangedShard, read_range
from mlra_jax.paths import is_remote, local_path

MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MARKER = "prepare.json"  # written by prepare beside the shards it made: inputs and tokens per shard


class DataError(ValueError):
    """Token data is missing or malformed; the message names the file and the fix."""


def write_shard(path: Path | epath.Path, tokens: np.ndarray) -> None:
    """Write tokens atomically (a partial file never carries the final name); local or on a bucket, where
    an object appears only once uploaded whole (no temporary name, whose rename would be a copy)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"token ids must lie in [0, 65535] to fit uint16 shards; got [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    tmp = path if is_remote(path) else path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    if tmp != path:
        tmp.replace(path)


def open_shard(path: Path | epath.Path) -> np.ndarray | RangedShard:
    """The tokens of a shard, after checking header and size: a read-only uint16 memmap of a local file,
    a RangedShard (read by byte range) of one on an object store."""
    try:
        return _open_shard(path)
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err}); check that it is a readable token shard "
                        f"file and its permissions") from None


def _size_and_header(path: Path | epath.Path) -> tuple[int, np.ndarray]:
    """The file's size in bytes and its first (up to) HEADER_INTS int32."""
    if not is_remote(path):
        local = local_path(path)
        return local.stat().st_size, np.fromfile(local, dtype=np.int32, count=HEADER_INTS)
    with path.open("rb") as f:
        head = read_range(f, 0, HEADER_BYTES)
    return epath.Path(path).stat().length, np.frombuffer(head[:len(head) // 4 * 4], dtype=np.int32)


def _open_shard(path: Path | epath.Path) -> np.ndarray | RangedShard:
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a token shard; rename it or narrow the data pattern")
    size, header = _size_and_header(path)
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte llm.c header; the file is "
                        f"truncated or not a token shard (re-create it with python -m mlra_jax.data.prepare)")
    if header[0] != MAGIC:
        raise DataError(f"{path}: magic number {header[0]} is not llm.c's {MAGIC}; this is not a token shard "
                        f"(re-create it with python -m mlra_jax.data.prepare)")
    if header[1] != VERSION:
        raise DataError(f"{path}: shard version {header[1]} is not supported (expected {VERSION}: uint16 tokens)")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise DataError(f"{path}: the header promises {count} tokens ({HEADER_BYTES + 2 * count} bytes) but the "
                        f"file has {size} bytes; it is truncated or corrupt (re-create it)")
    if is_remote(path):
        return RangedShard(epath.Path(path), HEADER_BYTES, count)
    return np.memmap(local_path(path), dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))


def find_shards(directory: Path | epath.Path, pattern: str) -> list[Path | epath.Path]:
    if not directory.is_dir():
        raise DataError(f"data directory {directory} does not exist; create it with "
                        f"`python -m mlra_jax.data.prepare --input <text files or dataset> --output {directory}` "
                        f"or train on the shipped corpus with --data.dataset=builtin")
    paths = sorted(directory.glob(pattern))
    if not paths:
        present = ", ".join(sorted(p.name for p in directory.iterdir())[:8]) or "nothing"
        raise DataError(f"no file in {directory} matches {pattern!r} (it holds: {present}); set "
                        f"--data.train_pattern / --data.val_pattern")
    folders = [p.name for p in paths if p.is_dir()]
    if folders:
        raise DataError(f"{directory}: {', '.join(folders[:5])} match the shard pattern {pattern!r} but are folders; "
                        f"rename them or narrow --data.train_pattern / --data.val_pattern")
    marker = directory / MARKER
    if marker.is_file():  # shards not made by the prepare that wrote the marker would be mixed in silently
        try:
            listed = json.loads(marker.read_text())["shards"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"{marker} is damaged ({type(err).__name__}); re-create the folder with "
                            f"python -m mlra_jax.data.prepare --overwrite") from None
        strangers = [p.name for p in paths if p.name not in listed]
        if strangers:
            raise DataError(f"{directory}: {', '.join(strangers[:5])} match {pattern!r} but were not written by the "
                            f"prepare that made this folder ({MARKER}); remove them or narrow the data pattern")
    return paths
