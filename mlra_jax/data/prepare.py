"""Tokenize text into llm.c shards with the GPT-2 tokenizer (offline).

    python -m mlra_jax.data.prepare --input corpus/ --output data/mine
    python -m mlra_jax.data.prepare --input docs.jsonl --output data/mine --text_field body
    python -m mlra_jax.data.prepare --input hf:HuggingFaceFW/fineweb-edu:sample-10BT --output data/fineweb_edu

Inputs: .txt files (one document each), .jsonl / .jsonl.gz (one document per line,
under --text_field), .parquet (a column named --text_field), folders of those, and,
where the network allows, `hf:NAME[:CONFIG]` (Hugging Face datasets, streamed) or
`tfds:NAME` (TensorFlow Datasets). The first --val_documents documents go to
`{prefix}_val_000000.bin`, the rest to `{prefix}_train_000001.bin`, ... (llm.c's naming).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import tiktoken

from mlra_jax.data.shards import DataError, write_shard
from mlra_jax.data.tokenizer import encode_documents, gpt2_tokenizer

_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")


def _read_file(path: Path, text_field: str) -> Iterator[str]:
    name = path.name
    if name.endswith(".txt"):
        yield path.read_text(encoding="utf-8")
    elif name.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if text_field not in record:
                    raise DataError(f"{path}:{number} has no field {text_field!r} (fields: {', '.join(record)}); "
                                    f"pass --text_field")
                yield record[text_field]
    elif name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise DataError("reading .parquet needs pyarrow: pip install pyarrow") from err
        table = pq.ParquetFile(path)
        if text_field not in table.schema_arrow.names:
            raise DataError(f"{path} has no column {text_field!r} (columns: {', '.join(table.schema_arrow.names)}); "
                            f"pass --text_field")
        for batch in table.iter_batches(columns=[text_field]):
            yield from batch.column(0).to_pylist()
    else:
        raise DataError(f"{path}: unsupported file type; use one of {', '.join(_SUFFIXES)}")


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
    path = Path(source)
    if not path.exists():
        raise DataError(f"input {source} does not exist (a file, a folder, hf:NAME or tfds:NAME)")
    files = sorted(p for p in path.rglob("*") if p.name.endswith(_SUFFIXES)) if path.is_dir() else [path]
    if not files:
        raise DataError(f"folder {path} holds no {', '.join(_SUFFIXES)} files")
    for file in files:
        yield from _read_file(file, text_field)


def write_token_shards(tokenizer: tiktoken.Encoding, documents: Iterable[str], out_dir: Path, prefix: str,
                       shard_tokens: int = 100_000_000, first_index: int = 0, batch: int = 1024) -> list[Path]:
    """Tokenize documents into shards of at most shard_tokens tokens named {prefix}_{index:06d}.bin."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    buffer: list[np.ndarray] = []
    filled = 0

    def flush() -> None:
        nonlocal buffer, filled
        path = out_dir / f"{prefix}_{first_index + len(paths):06d}.bin"
        write_shard(path, np.concatenate(buffer) if buffer else np.zeros(0, np.uint16))
        paths.append(path)
        buffer, filled = [], 0

    iterator = iter(documents)
    while chunk := list(itertools.islice(iterator, batch)):
        for tokens in encode_documents(tokenizer, chunk):
            while filled + tokens.size > shard_tokens:  # split across shards, as llm.c does
                room = shard_tokens - filled
                buffer.append(tokens[:room])
                tokens = tokens[room:]
                flush()
            buffer.append(tokens)
            filled += tokens.size
    if filled or not paths:
        flush()
    return paths


def prepare(source: str, output: Path, prefix: str, val_documents: int, shard_tokens: int,
            text_field: str = "text") -> tuple[list[Path], list[Path]]:
    tokenizer = gpt2_tokenizer()
    documents = iter_documents(source, text_field)
    val = (write_token_shards(tokenizer, itertools.islice(documents, val_documents), output, f"{prefix}_val",
                              shard_tokens) if val_documents else [])
    train = write_token_shards(tokenizer, documents, output, f"{prefix}_train", shard_tokens, first_index=len(val))
    return val, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlra_jax.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="file, folder, hf:NAME[:CONFIG] or tfds:NAME")
    parser.add_argument("--output", required=True, type=Path, help="folder for the shards")
    parser.add_argument("--prefix", default="data", help="shard name prefix (the reference uses fineweb)")
    parser.add_argument("--val_documents", type=int, default=1000, help="documents in the validation shard")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument("--text_field", default="text", help="the text field of .jsonl/.parquet/datasets records")
    args = parser.parse_args(argv)
    try:
        val, train = prepare(args.input, args.output, args.prefix, args.val_documents, args.shard_tokens,
                             args.text_field)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in val + train:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
