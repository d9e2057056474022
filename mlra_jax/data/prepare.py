"""Tokenize text into llm.c shards with the GPT-2 tokenizer (offline).

    mlra prepare --input corpus/ --output data/mine
    mlra prepare --input docs.jsonl --output data/mine --text_field body
    mlra prepare --input hf:HuggingFaceFW/fineweb-edu:sample-10BT --output data/fineweb_edu
    # an eval set: 0.1B tokens of every 10th validation document, all in _val_ shards
    mlra prepare --input hf:allenai/c4:en --split validation --every 10 --max_tokens 1e8 \\
        --val_documents 1000000000 --output data/c4_eval
    # compare a prepared folder's shards with its prepare.json (sizes and sha256)
    mlra prepare --verify data/mine

Inputs: .txt files (one document each), .jsonl / .jsonl.gz (one document per line,
under --text_field), .parquet (a column named --text_field), folders of those, and
(pip install 'mlra-jax[data]') `hf:NAME[:CONFIG]` (Hugging Face datasets, streamed),
`hf:FOLDER` (saved by `datasets`, or of data files) or `tfds:NAME[:CONFIG]` (TensorFlow
Datasets), each with --split. --skip_documents and --every pick documents K, K + N, ...;
--max_tokens stops reading once that many tokens are written (the last document cut there).
Documents with no text (empty, whitespace only, null) are skipped and counted; an input left with
none is an error, and nothing is written.
The first --val_documents documents go to
`{prefix}_val_000000.bin`, the rest to `{prefix}_train_000001.bin`, ... (llm.c's naming).
The folder appears only when complete, with prepare.json (inputs, documents, and each shard's tokens,
bytes and sha256, which training checks: see data/shards.py); a non-empty --output is replaced only with
--overwrite. One prepare at a time writes an --output: a second one is refused while the first runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import itertools
import json
import math
import os
import re
import secrets
import shutil
import sys
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

import numpy as np
import tiktoken
from etils import epath

from mlra_jax.cli import command_parser
from mlra_jax.command import command
from mlra_jax.data.documents import input_files, iter_documents
from mlra_jax.data.shards import MARKER, DataError, read_marker, verify_shards, write_shard
from mlra_jax.data.tokenizer import encode_documents, gpt2_tokenizer
from mlra_jax.file_lock import try_lock
from mlra_jax.guards import atomic_write_text, check_output_path
from mlra_jax.paths import as_path, is_remote, local_path


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
            tokens = tokens[: self.left]
            self.left -= tokens.size
        self.documents, self.tokens = self.documents + 1, self.tokens + tokens.size
        return tokens


def write_token_shards(
    tokenizer: tiktoken.Encoding,
    documents: Iterable[str],
    out_dir: Path | epath.Path,
    prefix: str,
    shard_tokens: int = 100_000_000,
    first_index: int = 0,
    batch: int = 1024,
    budget: TokenBudget | None = None,
    files: dict[str, dict[str, Any]] | None = None,
) -> list[Path]:
    """Tokenize documents into shards of at most shard_tokens tokens named {prefix}_{index:06d}.bin,
    until the budget (if any) is spent; `files` (if given) gets each shard's name -> tokens, bytes and sha256."""
    if shard_tokens < 1:
        raise DataError(f"--shard_tokens {shard_tokens} is not allowed: give a whole number >= 1")
    budget = budget or TokenBudget()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    buffer: list[np.ndarray] = []
    filled = 0

    def flush() -> None:
        nonlocal buffer, filled
        path = out_dir / f"{prefix}_{first_index + len(paths):06d}.bin"
        written = write_shard(path, np.concatenate(buffer) if buffer else np.zeros(0, np.uint16))
        if files is not None:
            files[path.name] = written
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


class _Texts:
    """The documents to tokenize: those with text, counting the documents read and the empty ones skipped."""

    def __init__(self, documents: Iterable[str]):
        self.read = self.empty = 0
        self._documents = iter(documents)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while True:
            text = next(self._documents)
            self.read += 1
            if text and not text.isspace():
                return text
            self.empty += 1


class _OutputLock:
    """One prepare at a time per --output: an exclusive OS lock (flock) on `.NAME.lock` beside it, held until the
    output is in place and then removed (the kernel releases it however the process ends). A second prepare is
    refused, not queued: its options may differ. An object store has no locks; there each run stages under a name
    of its own and the shards of two runs are never mixed (the one that finishes first keeps the folder)."""

    def __init__(self, output: epath.Path):
        self.output = output
        self.path = None if is_remote(output) else local_path(output.parent) / f".{output.name}.lock"
        self._file: IO[str] | None = None

    def __enter__(self) -> _OutputLock:
        if self.path is None:
            return self
        handle, holder = try_lock(self.path)
        if handle is None:
            raise DataError(
                f"another prepare ({holder or 'another process'}) is writing --output {self.output}; wait for it "
                f"to finish or choose another folder. Nothing was written"
            )
        self._file = handle
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()  # before unlocking: a waiter that then locks the removed file tries again
            self._file.close()  # releases the lock
            self._file = None


def _check_counts(**counts: tuple[int | None, int]) -> None:
    """Each option (name -> (value, least allowed value); None: not set) is a whole number at least that."""
    for name, (value, least) in counts.items():
        if value is not None and (int(value) != value or value < least):
            raise DataError(f"--{name} {value!r} is not allowed: give a whole number >= {least}")


def _inputs(source: str) -> list[str]:
    """The local paths a source reads, which --output must not replace or lie inside."""
    if source.startswith("hf:") and Path(source[3:]).exists():
        return [source[3:]]
    return [] if source.startswith(("hf:", "tfds:")) else [source]


def _check_output(output: epath.Path, overwrite: bool) -> bool:
    """Refuse an output that would mix old shards with new ones; nothing is written. Returns whether it exists."""
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output} is a file; give a folder for the shards")
    existing = sorted(output.iterdir()) if output.is_dir() else []
    if existing and not overwrite:
        names = ", ".join(p.name for p in existing[:5]) + (", ..." if len(existing) > 5 else "")
        raise DataError(
            f"--output {output} is not empty (it holds {names}); pass --overwrite to replace the shards a "
            f"previous prepare wrote there, or choose another folder. Nothing was written"
        )
    foreign = [p.name for p in existing if not (p.name == MARKER or (p.is_file() and p.name.endswith(".bin")))]
    if foreign:
        raise DataError(
            f"--overwrite replaces only token shards and {MARKER}, but --output {output} also holds "
            f"{', '.join(foreign[:5])}; move them away or choose another folder. Nothing was written"
        )
    return output.exists()


def _remove_stale(output: epath.Path) -> None:
    """Under the lock, the staging folders of killed prepares of a local `output` (and folders it replaced, once it is
    in place): no other prepare can be writing them."""
    if is_remote(output):
        return  # no lock tells whether another run still writes them
    kinds = "partial|replaced" if output.is_dir() else "partial"
    stale = re.compile(rf"\.{re.escape(output.name)}\.({kinds})(-\d+-[0-9a-f]{{8}})?")
    for folder in local_path(output.parent).iterdir():
        if stale.fullmatch(folder.name) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def _unique(output: epath.Path, kind: str) -> str:
    """A hidden sibling name of `output` for this run alone (two runs on an object store never share one)."""
    return f".{output.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


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
        return DataError(
            f"no space left on the disk of {output.parent} while writing {err.filename or 'a shard'};"
            f" free space there or choose another --output. {output} was left as it was"
        )
    return DataError(f"cannot write {err.filename or output}: {err.strerror or err}. {output} was left as it was")


def _no_text(source: str, texts: _Texts, text_field: str, skip_documents: int) -> DataError:
    nothing = "Nothing was written"
    if texts.read == 0 and skip_documents:
        return DataError(
            f"--skip_documents {skip_documents} is past the end of {source}: no document was left to "
            f"tokenize; lower --skip_documents (and check --split). {nothing}"
        )
    if texts.read == 0:
        return DataError(
            f"{source} holds no documents (empty files, or no records in the split); check the input "
            f"and --split. {nothing}"
        )
    documents = "its only document has" if texts.read == 1 else f"all {texts.read:,} documents read have"
    return DataError(
        f"{source}: {documents} no text (empty, whitespace only or null {text_field!r}), so there is "
        f"nothing to train on; check the input and --text_field. {nothing}"
    )


def prepare(
    source: str,
    output: str | Path | epath.Path,
    prefix: str,
    val_documents: int,
    shard_tokens: int,
    text_field: str = "text",
    overwrite: bool = False,
    max_tokens: int | None = None,
    split: str | None = None,
    skip_documents: int = 0,
    every: int = 1,
) -> dict[str, Any]:
    """Tokenize `source` into shards in `output` and return what the marker file records.

    Of the input (its `split`, for datasets) documents skip_documents, skip_documents + every, ... are
    read; those with no text are skipped; the first val_documents of the others go to the validation shards;
    reading stops once max_tokens tokens are written, the last document cut at the limit. An input with no
    text raises a DataError, and nothing is written.

    The shards are written into a hidden sibling folder of this run's own that replaces `output` only when complete
    (with the marker `prepare.json`: inputs, documents, and each shard's tokens, bytes and sha256), so an
    interrupted prepare leaves `output` as it was and never a partial set under its name; a local `output` is
    locked meanwhile (a second prepare into it is refused). `output` may be a URL (gs://bucket/data), where the
    final rename is a copy by the object store."""
    _check_counts(
        val_documents=(val_documents, 0),
        shard_tokens=(shard_tokens, 1),
        max_tokens=(max_tokens, 1),
        skip_documents=(skip_documents, 0),
        every=(every, 1),
    )
    output = as_path(output)
    files = input_files(source)
    check_output_path(output, _inputs(source), kind="folder")
    with _OutputLock(output):
        existed = _check_output(output, overwrite)
        _remove_stale(output)
        staging = output.parent / _unique(output, "partial")
        try:
            tokenizer = gpt2_tokenizer()
            texts = _Texts(iter_documents(source, text_field, split, skip_documents, every))
            budget, written = TokenBudget(max_tokens), {}
            val = (
                write_token_shards(
                    tokenizer,
                    itertools.islice(texts, val_documents),
                    staging,
                    f"{prefix}_val",
                    shard_tokens,
                    budget=budget,
                    files=written,
                )
                if val_documents
                else []
            )
            val_count = budget.documents
            train = write_token_shards(
                tokenizer,
                texts,
                staging,
                f"{prefix}_train",
                shard_tokens,
                first_index=len(val),
                budget=budget,
                files=written,
            )
            if budget.documents == 0:
                raise _no_text(source, texts, text_field, skip_documents)
            tokens = {p.name: written[p.name]["tokens"] for p in val + train}
            record = {
                "format": "llm.c token shards (uint16, version 1)",
                "tokenizer": "gpt2",
                "inputs": [str(f.absolute()) for f in files] or [source],
                "text_field": text_field,
                "split": split,
                "skip_documents": skip_documents,
                "every": every,
                "max_tokens": max_tokens,
                "documents": {"val": val_count, "train": budget.documents - val_count},
                "empty_documents_skipped": texts.empty,
                "tokens": {"val": sum(tokens[p.name] for p in val), "train": sum(tokens[p.name] for p in train)},
                "shards": tokens,
                "files": {name: {"bytes": info["bytes"], "sha256": info["sha256"]} for name, info in written.items()},
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
            atomic_write_text(staging / MARKER, json.dumps(record, indent=1))
            if output.exists() and not existed:  # an object store has no lock: another prepare finished first
                raise DataError(
                    f"another prepare wrote --output {output} while this one ran (an object store has no "
                    f"locks); its shards were kept and this run's discarded: run again with --overwrite to "
                    f"replace them, or choose another folder"
                )
        except OSError as err:
            _remove(staging, ignore_errors=True)
            raise _write_error(err, output) from None
        except BaseException:
            _remove(staging, ignore_errors=True)
            raise
        if output.exists():
            replaced = output.parent / _unique(output, "replaced")
            output.rename(replaced)
            staging.rename(output)
            replaced.rmtree()
        else:
            staging.rename(output)
    return record


def verify(folder: str | Path | epath.Path) -> str:
    """Compare a prepared folder's shards with its prepare.json: every listed shard there, with the recorded size and
    sha256, and no other shard; a DataError naming the first that differs. Returns what was checked."""
    folder = as_path(folder)
    if not folder.is_dir():
        raise DataError(f"--verify {folder} is not a folder; give a folder made by mlra prepare")
    record = read_marker(folder)
    if record is None:
        raise DataError(
            f"{folder} has no {MARKER}, so there is nothing to verify its shards against (only folders "
            f"made by mlra prepare record their shards)"
        )
    names = sorted(record["shards"])
    missing = [name for name in names if not (folder / name).is_file()]
    strangers = sorted(p.name for p in folder.glob("*.bin") if p.name not in record["shards"])
    if missing or strangers:
        problem = (
            f"{', '.join(missing[:5])} listed in {MARKER} are missing"
            if missing
            else f"{', '.join(strangers[:5])} are not listed in {MARKER}"
        )
        raise DataError(f"{folder}: {problem}; re-create the folder with mlra prepare --overwrite")
    verify_shards(folder, [folder / name for name in names], record, checksums=True)
    checked = "sizes and sha256" if record.get("files") else f"sizes only: this {MARKER} predates checksums"
    return f"{folder}: the {len(names)} shards match {MARKER} ({checked})"


def _count(least: int) -> Callable[[str], int]:
    """A whole-number option of at least `least`; 1e8 and 100_000_000 are accepted for token counts."""

    def parse(text: str) -> int:
        try:
            value = float(text) if "e" in text.lower() else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not math.isfinite(value) or value < least or value != int(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {least}")
        return int(value)

    return parse


@command
def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mlra prepare", __doc__)
    parser.add_argument("--input", help="file, folder, hf:NAME[:CONFIG], hf:FOLDER or tfds:NAME[:CONFIG] (required)")
    parser.add_argument("--output", help="folder for the shards, local or gs://... (required)")
    parser.add_argument("--prefix", default="data", help="shard name prefix (the reference uses fineweb)")
    parser.add_argument(
        "--val_documents",
        type=_count(0),
        default=1000,
        metavar="N",
        help="documents in the validation shards (0: none)",
    )
    parser.add_argument(
        "--shard_tokens", type=_count(1), default=100_000_000, metavar="N", help="tokens per shard (at least 1)"
    )
    parser.add_argument("--text_field", default="text", help="the text field of .jsonl/.parquet/datasets records")
    parser.add_argument("--split", help="the split of an hf: or tfds: input (default train), e.g. validation")
    parser.add_argument(
        "--skip_documents", type=_count(0), default=0, metavar="K", help="skip the first K documents of the input"
    )
    parser.add_argument(
        "--every",
        type=_count(1),
        default=1,
        metavar="N",
        help="then keep every N-th document (a sample spread over the input)",
    )
    parser.add_argument(
        "--max_tokens",
        type=_count(1),
        metavar="N",
        help="stop reading once N tokens are written, the last document cut at the limit",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the shards in a non-empty --output (it must hold only shards and prepare.json)",
    )
    parser.add_argument(
        "--verify",
        metavar="FOLDER",
        help="only compare FOLDER's shards with its prepare.json (sizes and sha256), then exit; "
        "training checks the sizes at every start, the sha256 with MLRA_JAX_VERIFY_SHARDS=1",
    )
    args = parser.parse_args(argv)
    if args.verify:
        print(verify(args.verify))
        return 0
    missing = [option for option in ("--input", "--output") if getattr(args, option[2:]) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    record = prepare(
        args.input,
        args.output,
        args.prefix,
        args.val_documents,
        args.shard_tokens,
        args.text_field,
        args.overwrite,
        args.max_tokens,
        args.split,
        args.skip_documents,
        args.every,
    )
    output = as_path(args.output)
    for name, tokens in record["shards"].items():
        print(f"{output / name}  {tokens:,} tokens")
    empty = record["empty_documents_skipped"]
    skipped = f" ({empty:,} with no text skipped)" if empty else ""
    print(
        f"{record['documents']['val']:,} validation and {record['documents']['train']:,} training documents"
        f"{skipped}; {output / MARKER} lists the inputs and shards"
    )
    if not record["documents"]["train"]:
        print(
            f"note: all documents went to the validation shards (--val_documents {args.val_documents}): this folder "
            f"serves evaluation only; lower --val_documents to train on it"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
