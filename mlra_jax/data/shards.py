"""llm.c token shards: a 256 x int32 header (magic 20240520, version 1, token count),
then the tokens as uint16. The official preprocessed data and llm.c's FineWeb scripts
write this format. Local shards are memory-mapped; shards on an object store (gs://) are read by
byte range (ranged_shard.py), after the same header checks.

A folder made by prepare holds `prepare.json`, which lists each shard with its tokens, bytes and sha256.
Training and evaluation refuse a shard of such a folder that the marker does not list, one it lists that
is gone, and one whose size differs from the recorded one (a stat per shard, at every start). Checksums
are compared only when asked (hashing 100s of GB at every start is slow): MLRA_JAX_VERIFY_SHARDS=1 for
a run, or `mlra prepare --verify FOLDER`. Folders without the marker (llm.c's
downloads) are read as they are."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from etils import epath

from mlra_jax.data.ranged_shard import RangedShard, read_range
from mlra_jax.paths import is_remote, local_path

MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MARKER = "prepare.json"  # written by prepare beside the shards it made: inputs, tokens, bytes and sha256 per shard
VERIFY_VARIABLE = "MLRA_JAX_VERIFY_SHARDS"  # 1: also compare every shard's sha256 with the marker's at each start
_REMAKE = "re-create the folder with mlra prepare --overwrite, or restore the shard"


class DataError(ValueError):
    """Token data is missing or malformed; the message names the file and the fix."""


def write_shard(path: Path | epath.Path, tokens: np.ndarray) -> dict[str, Any]:
    """Write tokens atomically (a partial file never carries the final name); local or on a bucket, where
    an object appears only once uploaded whole (no temporary name, whose rename would be a copy).
    Returns what prepare.json records of the file: {"tokens", "bytes", "sha256"}."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"token ids must lie in [0, 65535] to fit uint16 shards; got [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    tmp = path if is_remote(path) else path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    with tmp.open("wb") as f:
        for part in (header.tobytes(), tokens.astype(np.uint16).tobytes()):
            digest.update(part)
            f.write(part)
    if tmp != path:
        tmp.replace(path)
    return {"tokens": int(tokens.size), "bytes": HEADER_BYTES + 2 * int(tokens.size), "sha256": digest.hexdigest()}


def open_shard(path: Path | epath.Path) -> np.ndarray | RangedShard:
    """The tokens of a shard, after checking header and size: a read-only uint16 memmap of a local file,
    a RangedShard (read by byte range) of one on an object store."""
    try:
        return _open_shard(path)
    except OSError as err:
        raise DataError(
            f"{path}: cannot be read ({err.strerror or err}); check that it is a readable token shard "
            f"file and its permissions"
        ) from None


def _size_and_header(path: Path | epath.Path) -> tuple[int, np.ndarray]:
    """The file's size in bytes and its first (up to) HEADER_INTS int32."""
    if not is_remote(path):
        local = local_path(path)
        return local.stat().st_size, np.fromfile(local, dtype=np.int32, count=HEADER_INTS)
    with path.open("rb") as f:
        head = read_range(f, 0, HEADER_BYTES)
    return epath.Path(path).stat().length, np.frombuffer(head[: len(head) // 4 * 4], dtype=np.int32)


def _open_shard(path: Path | epath.Path) -> np.ndarray | RangedShard:
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a token shard; rename it or narrow the data pattern")
    size, header = _size_and_header(path)
    if size < HEADER_BYTES:
        raise DataError(
            f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte llm.c header; the file is "
            f"truncated or not a token shard (re-create it with mlra prepare)"
        )
    if header[0] != MAGIC:
        raise DataError(
            f"{path}: magic number {header[0]} is not llm.c's {MAGIC}; this is not a token shard "
            f"(re-create it with mlra prepare)"
        )
    if header[1] != VERSION:
        raise DataError(f"{path}: shard version {header[1]} is not supported (expected {VERSION}: uint16 tokens)")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise DataError(
            f"{path}: the header promises {count} tokens ({HEADER_BYTES + 2 * count} bytes) but the "
            f"file has {size} bytes; it is truncated or corrupt (re-create it)"
        )
    if is_remote(path):
        return RangedShard(epath.Path(path), HEADER_BYTES, count)
    return np.memmap(local_path(path), dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))


def find_shards(directory: Path | epath.Path, pattern: str) -> list[Path | epath.Path]:
    if not directory.is_dir():
        raise DataError(
            f"data directory {directory} does not exist; create it with "
            f"`mlra prepare --input <text files or dataset> --output {directory}` "
            f"or train on the shipped corpus with --data.dataset=builtin"
        )
    paths = sorted(directory.glob(pattern))
    if not paths:
        present = ", ".join(sorted(p.name for p in directory.iterdir())[:8]) or "nothing"
        raise DataError(
            f"no file in {directory} matches {pattern!r} (it holds: {present}); set "
            f"--data.train_pattern / --data.val_pattern"
        )
    folders = [p.name for p in paths if p.is_dir()]
    if folders:
        raise DataError(
            f"{directory}: {', '.join(folders[:5])} match the shard pattern {pattern!r} but are folders; "
            f"rename them or narrow --data.train_pattern / --data.val_pattern"
        )
    record = read_marker(directory)
    if record is not None:  # shards not made by the prepare that wrote the marker would be mixed in silently
        strangers = [p.name for p in paths if p.name not in record["shards"]]
        if strangers:
            raise DataError(
                f"{directory}: {', '.join(strangers[:5])} match {pattern!r} but were not written by the "
                f"prepare that made this folder ({MARKER}); remove them or narrow the data pattern"
            )
        missing = sorted(set(fnmatch.filter(record["shards"], pattern)) - {p.name for p in paths})
        if missing:
            raise DataError(
                f"{directory}: {', '.join(missing[:5])} listed in {MARKER} (matching {pattern!r}) are "
                f"missing; {_REMAKE}"
            )
        verify_shards(directory, paths, record)
    return paths


def read_marker(directory: Path | epath.Path) -> dict[str, Any] | None:
    """The prepare.json of a shard folder (None if it has none), checked enough to be used."""
    marker = directory / MARKER
    if not marker.is_file():
        return None
    try:
        record = json.loads(marker.read_text())
        shards, files = record["shards"], record.get("files", {})
        if not all(isinstance(tokens, int) for tokens in shards.values()) or not all(
            isinstance(file["bytes"], int) for file in files.values()
        ):
            raise TypeError("shards")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(
            f"{marker} is damaged ({type(err).__name__}); re-create the folder with mlra prepare --overwrite"
        ) from None
    return record


def verify_shards(
    directory: Path | epath.Path,
    paths: Iterable[Path | epath.Path],
    record: dict[str, Any],
    checksums: bool | None = None,
) -> None:
    """Each of `paths` (shards of `directory` listed in its marker `record`) has the size prepare recorded (from
    the marker's "files", or its token count for markers written before those), and with `checksums` (default:
    the MLRA_JAX_VERIFY_SHARDS variable) the recorded sha256; a DataError naming the first that differs."""
    if checksums is None:
        checksums = os.environ.get(VERIFY_VARIABLE, "") not in ("", "0")
    files = record.get("files", {})
    for path in paths:
        listed = files.get(path.name) or {"bytes": HEADER_BYTES + 2 * int(record["shards"][path.name])}
        size = _size(path)
        if size != listed["bytes"]:
            raise DataError(
                f"{path}: {size:,} bytes, but prepare wrote {listed['bytes']:,} bytes under this name "
                f"({directory / MARKER}); the shard was replaced or damaged since: {_REMAKE}"
            )
        if checksums and "sha256" in listed and sha256_of(path) != listed["sha256"]:
            raise DataError(
                f"{path}: its sha256 differs from the one prepare recorded ({directory / MARKER}); the "
                f"shard was replaced or damaged since: {_REMAKE}"
            )


def fingerprint(directory: Path | epath.Path, paths: Iterable[Path | epath.Path]) -> str:
    """A digest of the shards `paths` of `directory`: their names and sizes, and the sha256 that prepare recorded for
    each (prepare.json), reading no shard: other data under the same names (prepare --overwrite) gives another."""
    files = (read_marker(directory) or {}).get("files", {})
    entries = [[p.name, _size(p), files.get(p.name, {}).get("sha256")] for p in paths]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def sha256_of(path: Path | epath.Path) -> str:
    digest = hashlib.sha256()
    with (local_path(path) if not is_remote(path) else epath.Path(path)).open("rb") as f:
        while block := f.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()


def _size(path: Path | epath.Path) -> int:
    try:
        return local_path(path).stat().st_size if not is_remote(path) else epath.Path(path).stat().length
    except OSError as err:
        raise DataError(
            f"{path}: cannot be read ({err.strerror or err}); check that it is a readable token shard "
            f"file and its permissions"
        ) from None
