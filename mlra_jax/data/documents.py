"""Documents to tokenize: local .txt / .jsonl / .jsonl.gz / .parquet files and folders of them, Hugging
Face datasets (`hf:NAME[:CONFIG]`) and TensorFlow Datasets (`tfds:NAME`).

A file that cannot be read as what its name says raises a DataError naming the file (and the
line, for JSON lines) and the fix, never a bare decoding traceback.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import IO, Iterator

from mlra_jax.data.shards import DataError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
_UTF8_FIX = "convert it to UTF-8 (for example iconv -f latin1 -t utf-8) or remove it from the input"


def _text_file(path: Path) -> Iterator[str]:
    data = path.read_bytes()
    if b"\0" in data[:65536]:
        raise DataError(f"{path}: holds NUL bytes, so it is binary, not text; remove it from the input")
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); {_UTF8_FIX}") from None


def _json_lines(path: Path, f: IO[bytes], text_field: str) -> Iterator[str]:
    for number, raw in enumerate(f, 1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{where}: not UTF-8 (byte {err.start} of the line); {_UTF8_FIX}") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg}, column {err.colno}); each line of a JSON lines "
                            f"file is one object such as {{\"{text_field}\": \"...\"}}: fix or remove the line") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with a {text_field!r} field")
        if text_field not in record:
            raise DataError(f"{where} has no field {text_field!r} (fields: {', '.join(record)}); pass --text_field")
        if not isinstance(record[text_field], str):
            raise DataError(f"{where}: field {text_field!r} is a {type(record[text_field]).__name__}, not text")
        yield record[text_field]


def _parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError("reading .parquet needs pyarrow: pip install pyarrow") from err
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err}); re-export it or "
                        f"remove it from the input") from None
    if text_field not in table.schema_arrow.names:
        raise DataError(f"{path} has no column {text_field!r} (columns: {', '.join(table.schema_arrow.names)}); "
                        f"pass --text_field")
    for batch in table.iter_batches(columns=[text_field]):
        yield from batch.column(0).to_pylist()


def read_file(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one local file: a .txt file is one document, the others one per record."""
    name = path.name
    try:
        if name.endswith(".txt"):
            yield from _text_file(path)
        elif name.endswith((".jsonl", ".jsonl.gz")):
            with (gzip.open if name.endswith(".gz") else open)(path, "rb") as f:
                yield from _json_lines(path, f, text_field)
        elif name.endswith(".parquet"):
            yield from _parquet(path, text_field)
        else:
            raise DataError(f"{path}: unsupported file type; use one of {', '.join(SUFFIXES)}")
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"{path}: not a complete gzip file ({err or type(err).__name__}); re-compress it or "
                        f"remove it from the input") from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err}); check that it is a readable file") from None


def iter_documents(source: str, text_field: str = "text") -> Iterator[str]:
    """Documents from a local file or folder, an `hf:` dataset or a `tfds:` dataset."""
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        try:
            import datasets
        except ImportError as err:
            raise DataError("hf: inputs need the Hugging Face datasets package: pip install datasets") from err
        for record in datasets.load_dataset(name, config or None, split="train", streaming=True):
            yield record[text_field]
        return
    if source.startswith("tfds:"):
        try:
            import tensorflow_datasets as tfds
        except ImportError as err:
            raise DataError("tfds: inputs need tensorflow-datasets: pip install tensorflow-datasets") from err
        for record in tfds.as_numpy(tfds.load(source[5:], split="train")):
            value = record[text_field]
            yield value.decode("utf-8") if isinstance(value, bytes) else value
        return
    for file in input_files(source):
        yield from read_file(file, text_field)


def input_files(source: str) -> list[Path]:
    """The local files a file or folder input reads, in order ([] for hf: and tfds: inputs)."""
    if source.startswith(("hf:", "tfds:")):
        return []
    path = Path(source)
    if not path.exists():
        raise DataError(f"input {source} does not exist (a file, a folder, hf:NAME or tfds:NAME)")
    files = sorted(p for p in path.rglob("*") if p.name.endswith(SUFFIXES) and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise DataError(f"folder {path} holds no {', '.join(SUFFIXES)} files")
    return files
