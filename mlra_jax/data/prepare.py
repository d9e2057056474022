"""Tokenize text into llm.c shards with the GPT-2 tokenizer (offline).

    python -m mlra_jax.data.prepare --input corpus/ --output data/mine
    python -m mlra_jax.data.prepare --input docs.jsonl --output data/mine --text_field body
    python -m mlra_jax.data.prepare --input hf:HuggingFaceFW/fineweb-edu:sample-10BT --output data/fineweb_edu
    # an eval set: 0.1B tokens of every 10th validation document, all in _val_ shards
    python -m mlra_jax.data.prepare --input hf:allenai/c4:en --split validation --every 10 --max_tokens 1e8 \
        --val_documents 1000000000 --output data/c4_eval

Inputs: .txt files (one document each), .jsonl / .jsonl.gz (one document per line,
under --text_field), .parquet (a column named --text_field), folders of those, and
(pip install 'mlra-jax[data]') `hf:NAME[:CONFIG]` (Hugging Face datasets, streamed),
`hf:FOLDER` (saved by `datasets`, or of data files) or `tfds:NAME[:CONFIG]` (TensorFlow
Datasets), each with --split. --skip_documents and --every pick documents K, K + N, ...;
--max_tokens stops reading once that many tokens are written (the last document cut there).
The first --val_documents documents go to
`{prefix}_val_000000.bin`, the rest to `{prefix}_train_000001.bin`, ... (llm.c's naming).
The folder appears only when complete, with prepare.json (inputs, documents, tokens per shard);
a non-empty --output is replaced only with --overwrite.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import tiktoken
from etils import epath

from mlra_jax.config import ConfigError
from mlra_jax.data.documents import input_files, iter_documents
from mlra_jax.data.shards import MARKER, DataError, open_shard, write_shard
from mlra_jax.data.tokenizer import encode_documents, gpt2_tokenizer
from mlra_jax.paths import as_path


class TokenBudget:
    """The tokens --max_tokens leaves to write (None: no limit), shared by the validation and training
    shards, and the documents written under it. The document that reaches the limit is cut there."""

    def __init__(self, limit: int | None = None):
        self.left, self.documents, self.tokens = limit, 0, 0

    def next_chunk(self, batch: int) -> int:
        """How many documents to read next: a whole batch far from the limit, fewer (one at the end) near
        it, so that the input is read past the document that reaches the limit only when the last
        documents are much longer than those before."""
        if self.left is None:
            return batch
        mean = self.tokens / self.documents if self.documents else float("inf")
        return min(batch, self.left, max(1, int(self.left / (2 * mean))))

    def take(self, tokens: np.ndarray) -> np.ndarray:
        if self.left is not None:
            tokens = tokens[:self.left]
            self.left -= tokens.size
        self.documents, self.tokens = self.documents + 1, self.tokens + tokens.size
        return tokens


def write_token_shards(tokenizer: tiktoken.Encoding, documents: Iterable[str], out_dir: Path | epath.Path,
                       prefix: str,
                       shard_tokens: int = 100_000_000, first_index: int = 0, batch: int = 1024,
                       budget: TokenBudget | None = None) -> list[Path]:
    """Tokenize documents into shards of at most shard_tokens tokens named {prefix}_{index:06d}.bin,
    until the budget (if any) is spent."""
    budget = budget or TokenBudget()
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
    while (size := budget.next_chunk(batch)) and (chunk := list(itertools.islice(iterator, size))):
        for tokens in encode_documents(tokenizer, chunk):
            if budget.left == 0:
                break  # the rest of the chunk is not written
            tokens = budget.take(tokens)
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


def _check_output(output: epath.Path, inputs: list[Path], overwrite: bool) -> None:
    """Refuse an output that would mix old shards with new ones or swallow the input; nothing is written."""
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output} is a file; give a folder for the shards")
    for file in inputs:
        if file.absolute().is_relative_to(output):
            raise DataError(f"the input {file} lies inside --output {output}; write the shards to another folder")
    existing = sorted(output.iterdir()) if output.is_dir() else []
    if existing and not overwrite:
        names = ", ".join(p.name for p in existing[:5]) + (", ..." if len(existing) > 5 else "")
        raise DataError(f"--output {output} is not empty (it holds {names}); pass --overwrite to replace the shards a "
                        f"previous prepare wrote there, or choose another folder. Nothing was written")
    foreign = [p.name for p in existing if not (p.name == MARKER or (p.is_file() and p.name.endswith(".bin")))]
    if foreign:
        raise DataError(f"--overwrite replaces only token shards and {MARKER}, but --output {output} also holds "
                        f"{', '.join(foreign[:5])}; move them away or choose another folder. Nothing was written")


def _remove(folder: epath.Path, ignore_errors: bool = False) -> None:
    """Delete a folder (local or on a bucket), if there."""
    try:
        if folder.exists():
            folder.rmtree()
    except OSError:
        if not ignore_errors:
            raise


def _write_error(err: OSError, output: epath.Path) -> DataError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DataError(f"no space left on the disk of {output.parent} while writing {err.filename or 'a shard'};"
                         f" free space there or choose another --output. {output} was left as it was")
    return DataError(f"cannot write {err.filename or output}: {err.strerror or err}. {output} was left as it was")


def prepare(source: str, output: str | Path | epath.Path, prefix: str, val_documents: int, shard_tokens: int,
            text_field: str = "text", overwrite: bool = False, max_tokens: int | None = None,
            split: str | None = None, skip_documents: int = 0, every: int = 1) -> dict[str, Any]:
    """Tokenize `source` into shards in `output` and return what the marker file records.

    Of the input (its `split`, for datasets) documents skip_documents, skip_documents + every, ... are
    read; the first val_documents of them go to the validation shards; reading stops once max_tokens
    tokens are written, the last document cut at the limit.

    The shards are written into a hidden sibling folder that replaces `output` only when complete (with
    the marker `prepare.json`: inputs, documents and tokens per shard), so an interrupted prepare leaves
    `output` as it was and never a partial set under its name. `output` may be a URL (gs://bucket/data),
    where the final rename is a copy by the object store."""
    output = as_path(output)
    files = input_files(source)
    _check_output(output, files, overwrite)
    staging = output.parent / f".{output.name}.partial"
    _remove(staging)  # left by an interrupted prepare
    try:
        tokenizer = gpt2_tokenizer()
        documents = iter_documents(source, text_field, split, skip_documents, every)
        budget = TokenBudget(max_tokens)
        val = write_token_shards(tokenizer, itertools.islice(documents, val_documents), staging, f"{prefix}_val",
                                 shard_tokens, budget=budget) if val_documents else []
        val_count = budget.documents
        train = write_token_shards(tokenizer, documents, staging, f"{prefix}_train", shard_tokens,
                                   first_index=len(val), budget=budget)
        sizes = {p.name: int(open_shard(p).size) for p in val + train}  # each shard's header read once
        record = {"format": "llm.c token shards (uint16, version 1)", "tokenizer": "gpt2",
                  "inputs": [str(f.absolute()) for f in files] or [source], "text_field": text_field,
                  "split": split, "skip_documents": skip_documents, "every": every, "max_tokens": max_tokens,
                  "documents": {"val": val_count, "train": budget.documents - val_count},
                  "tokens": {"val": sum(sizes[p.name] for p in val), "train": sum(sizes[p.name] for p in train)},
                  "shards": sizes,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        (staging / MARKER).write_text(json.dumps(record, indent=1))
    except OSError as err:
        _remove(staging, ignore_errors=True)
        raise _write_error(err, output) from None
    except BaseException:
        _remove(staging, ignore_errors=True)
        raise
    if output.exists():
        replaced = output.parent / f".{output.name}.replaced"
        _remove(replaced, ignore_errors=True)
        output.rename(replaced)
        staging.rename(output)
        replaced.rmtree()
    else:
        staging.rename(output)
    return record


def _count(text: str) -> int:
    """A non-negative integer option; 1e8 and 100_000_000 are accepted for token counts."""
    try:
        value = float(text) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlra_jax.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True,
                        help="file, folder, hf:NAME[:CONFIG], hf:FOLDER or tfds:NAME[:CONFIG]")
    parser.add_argument("--output", required=True, help="folder for the shards (local or gs://...)")
    parser.add_argument("--prefix", default="data", help="shard name prefix (the reference uses fineweb)")
    parser.add_argument("--val_documents", type=int, default=1000, help="documents in the validation shard")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument("--text_field", default="text", help="the text field of .jsonl/.parquet/datasets records")
    parser.add_argument("--split", help="the split of an hf: or tfds: input (default train), e.g. validation")
    parser.add_argument("--skip_documents", type=_count, default=0, metavar="K",
                        help="skip the first K documents of the input")
    parser.add_argument("--every", type=_count, default=1, metavar="N",
                        help="then keep every N-th document (a sample spread over the input)")
    parser.add_argument("--max_tokens", type=_count, metavar="N",
                        help="stop reading once N tokens are written, the last document cut at the limit")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the shards in a non-empty --output (it must hold only shards and prepare.json)")
    args = parser.parse_args(argv)
    for option, value in (("--every", args.every), ("--max_tokens", args.max_tokens)):
        if value == 0:
            parser.error(f"{option} must be at least 1")
    try:
        record = prepare(args.input, args.output, args.prefix, args.val_documents, args.shard_tokens,
                         args.text_field, args.overwrite, args.max_tokens, args.split, args.skip_documents,
                         args.every)
    except (DataError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    output = as_path(args.output)
    for name, tokens in record["shards"].items():
        print(f"{output / name}  {tokens:,} tokens")
    print(f"{record['documents']['val']:,} validation and {record['documents']['train']:,} training documents; "
          f"{output / MARKER} lists the inputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
