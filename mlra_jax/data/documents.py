"""Documents to tokenize: local .txt / .jsonl / .jsonl.gz / .parquet files and folders of them, Hugging
Face datasets (`hf:NAME[:CONFIG]`, or `hf:FOLDER` saved by `datasets` or of data files) and TensorFlow
Datasets (`tfds:NAME[:CONFIG]`), streamed or read by index, never loaded whole.

A file that cannot be read as what its name says raises a DataError naming the file (and the
line, for JSON lines, or the row, for parquet) and the fix, never a bare decoding traceback. A null
text is no document: it is read as "", which prepare skips and counts with the empty ones; a text
field of another type (a number, a list) is bad input.
"""

from __future__ import annotations

import gzip
import itertools
import json
import zlib
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Sized

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
            raise DataError(
                f"{where}: not valid JSON ({err.msg}, column {err.colno}); each line of a JSON lines "
                f'file is one object such as {{"{text_field}": "..."}}: fix or remove the line'
            ) from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with a {text_field!r} field")
        if text_field not in record:
            raise DataError(f"{where} has no field {text_field!r} (fields: {', '.join(record)}); pass --text_field")
        if not isinstance(record[text_field], (str, type(None))):
            raise DataError(f"{where}: field {text_field!r} is a {type(record[text_field]).__name__}, not text")
        yield record[text_field] or ""


def _parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError("reading .parquet needs pyarrow: pip install pyarrow") from err
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise DataError(
            f"{path}: not a readable parquet file ({type(err).__name__}: {err}); re-export it or "
            f"remove it from the input"
        ) from None
    if text_field not in table.schema_arrow.names:
        raise DataError(
            f"{path} has no column {text_field!r} (columns: {', '.join(table.schema_arrow.names)}); pass --text_field"
        )
    row = 0
    for batch in table.iter_batches(columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if not isinstance(value, (str, type(None))):
                raise DataError(
                    f"{path}: row {row} (counting from 0) of column {text_field!r} is a "
                    f"{type(value).__name__}, not text; pass the text column as --text_field, or "
                    f"re-export the file with text in it"
                )
            yield value or ""
            row += 1


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
        raise DataError(
            f"{path}: not a complete gzip file ({err or type(err).__name__}); re-compress it or "
            f"remove it from the input"
        ) from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err}); check that it is a readable file") from None


def iter_documents(
    source: str, text_field: str = "text", split: str | None = None, skip: int = 0, every: int = 1
) -> Iterator[str]:
    """Documents from a local file or folder, an `hf:` dataset or a `tfds:` dataset.

    `split` picks the split of a dataset (train by default); the documents kept are numbers skip,
    skip + every, skip + 2 every, ... An indexable dataset (a saved `datasets` folder, a TFDS array
    record data source) is read only at those numbers; a stream reads past the others."""
    if source.startswith(("hf:", "tfds:")):
        records = (
            _hf_records(source[3:], split or "train")
            if source.startswith("hf:")
            else _tfds_records(source[5:], split or "train")
        )
        for record in _sample(records, skip, every):
            yield _text_of(record, text_field, source)
        return
    if split is not None:
        raise DataError(f"--split {split} applies to hf: and tfds: inputs, not to {source}; leave it out")
    documents = (text for file in input_files(source) for text in read_file(file, text_field))
    yield from _sample(documents, skip, every)


def _sample(records: Iterable[Any], skip: int, every: int) -> Iterator[Any]:
    """Records skip, skip + every, ...: by index where the records allow it, so the others are never read."""
    if isinstance(records, Sized) and hasattr(records, "__getitem__"):
        return (records[i] for i in range(skip, len(records), every))
    return itertools.islice(records, skip, None, every)


def _text_of(record: Any, text_field: str, source: str) -> str:
    if not hasattr(record, "keys") or text_field not in record:
        fields = ", ".join(record.keys()) if hasattr(record, "keys") else type(record).__name__
        raise DataError(f"{source}: records have no field {text_field!r} (fields: {fields}); pass --text_field")
    value = record[text_field]
    if isinstance(value, bytes):  # TFDS text features read through TensorFlow
        value = value.decode("utf-8", errors="replace")
    if value is None:  # no document: skipped by prepare
        return ""
    if not isinstance(value, str):
        raise DataError(f"{source}: field {text_field!r} is a {type(value).__name__}, not text; pass --text_field")
    return value


def _hf_records(name: str, split: str) -> Iterable[Any]:
    """A Hugging Face dataset streamed from the Hub, or a local folder: one written by save_to_disk
    (memory-mapped, read by index) or one of data files (.jsonl, .parquet, ..., streamed)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"hf:{name} needs the Hugging Face datasets package: pip install 'mlra-jax[data]' (or pip install datasets)"
        ) from None
    folder = Path(name)
    try:
        if folder.is_dir() and any((folder / f).is_file() for f in ("state.json", "dataset_dict.json")):
            return _saved_split(datasets.load_from_disk(str(folder)), name, split)
        repo, _, config = (name, "", "") if folder.is_dir() else name.partition(":")
        return datasets.load_dataset(repo, config or None, split=split, streaming=True)
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many types for a missing dataset, split or network
        raise DataError(
            f"hf:{name} (split {split!r}) cannot be loaded ({type(err).__name__}: {err}); check the "
            f"name, the config after ':' and --split, or give a local folder as hf:/path"
        ) from None


def _saved_split(saved: Any, name: str, split: str) -> Any:
    """The split of a folder written by DatasetDict.save_to_disk; a saved Dataset is one split, taken as is."""
    if not hasattr(saved, "keys"):
        return saved
    if split not in saved:
        raise DataError(f"hf:{name} has no split {split!r} (splits: {', '.join(saved)}); pass --split")
    return saved[split]


def _tfds_records(name: str, split: str) -> Iterable[Any]:
    """A TFDS dataset as an array record data source (read by index, no TensorFlow needed), or streamed
    through tfds.load when it is stored as TFRecord files (that needs TensorFlow)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataError(
            f"tfds:{name} needs tensorflow-datasets: pip install 'mlra-jax[data]' (or pip install tensorflow-datasets)"
        ) from None
    name = name.replace(":", "/")  # tfds:NAME:CONFIG -> TFDS's NAME/CONFIG
    try:
        try:
            return tfds.data_source(name, split=split)
        except NotImplementedError:  # not array record files: iterate tf.data through TensorFlow
            return _tfds_stream(tfds, name, split)
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - TFDS raises many types for a missing dataset, split or download
        raise DataError(
            f"tfds:{name} (split {split!r}) cannot be loaded ({type(err).__name__}: {err}); check the "
            f"name, the config after ':', --split and TFDS_DATA_DIR"
        ) from None


def _tfds_stream(tfds: Any, name: str, split: str) -> Iterable[Any]:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        raise DataError(
            f"tfds:{name} is stored as TFRecord files, which need TensorFlow: pip install tensorflow-cpu"
        ) from None
    return tfds.as_numpy(tfds.load(name, split=split))


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
