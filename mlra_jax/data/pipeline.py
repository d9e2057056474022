"""grain pipelines over llm.c shards.

An example is a window of seq_len + 1 tokens (inputs and shifted targets) at a
multiple of seq_len inside one shard. Training shuffles the windows with a seed,
reshuffles every epoch, and gives process p of P the examples p, p + P, ... so that
the P local batches of step s together form global batch s; batch s is a pure
function of (seed, s). A checkpoint records how many examples were consumed, and a resumed run
starts the stream there, so a run resumed with another batch size continues at the right example.
"""

from __future__ import annotations

import os
from pathlib import Path

import grain
import numpy as np
from etils import epath

from mlra_jax.config import DataConfig
from mlra_jax.data.builtin import builtin_shards
from mlra_jax.data.shards import DataError, find_shards, fingerprint, open_shard, read_marker, verify_shards
from mlra_jax.paths import as_path


class TokenWindows:
    """Random-access source of [seq_len + 1] int32 windows over llm.c shards (local memmaps, or byte
    ranges of shards on a bucket)."""

    def __init__(self, paths: list[Path | epath.Path], seq_len: int, vocab_size: int):
        self.paths, self.seq_len, self.vocab_size = list(paths), seq_len, vocab_size
        self.shards = [open_shard(p) for p in self.paths]
        counts = [max(0, (s.size - 1) // seq_len) for s in self.shards]
        if sum(counts) == 0:
            raise DataError(
                f"shards {', '.join(map(str, self.paths))} hold fewer than {seq_len + 1} tokens each; "
                f"no window of seq_len={seq_len} fits"
            )
        self.starts = np.cumsum([0] + counts)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        offset = (index - int(self.starts[shard])) * self.seq_len
        window = np.asarray(self.shards[shard][offset : offset + self.seq_len + 1], dtype=np.int32)
        if window.max(initial=0) >= self.vocab_size:
            position = offset + int(window.argmax())
            raise DataError(
                f"{self.paths[shard]}: token id {window.max()} at position {position} is >= the model's "
                f"vocab_size {self.vocab_size}; the shard was made with another tokenizer, or raise "
                f"vocab_size"
            )
        return window

    def __repr__(self) -> str:  # grain logs the source
        return f"TokenWindows({len(self.paths)} shards, {len(self)} windows of {self.seq_len + 1})"


def data_directory(cfg: DataConfig) -> Path | epath.Path:
    """The shard folder: the built-in corpus, a local folder or a URL (gs://bucket/data)."""
    return builtin_shards() if cfg.dataset == "builtin" else as_path(cfg.dataset)


def check_data(cfg: DataConfig, seq_len: int, validation: bool, eval_sets: dict[str, str] | None = None) -> str:
    """What a run will read, checked before its state is built (minutes at 2.9B): the training shards (and the
    validation shards when `validation`) found, readable, holding a window of seq_len + 1 tokens, and each held-out
    eval set a readable token file; a DataError naming the first that is not. Returns a one-line summary."""
    directory = data_directory(cfg)
    patterns = (("training", cfg.train_pattern),) + ((("validation", cfg.val_pattern),) if validation else ())
    parts = []
    for kind, pattern in patterns:
        windows = TokenWindows(find_shards(directory, pattern), seq_len, vocab_size=2**16)
        parts.append(f"{kind}: {len(windows.paths)} shard(s), {len(windows):,} windows")
    for name, path in (eval_sets or {}).items():
        parts.append(f"{name}: {open_shard(as_path(path)).size:,} tokens")
    return f"data {directory}: " + "; ".join(parts)


def data_fingerprint(cfg: DataConfig) -> str:
    """The fingerprint of a run's training shards (shards.fingerprint), which its experiment.json records."""
    directory = data_directory(cfg)
    return fingerprint(directory, find_shards(directory, cfg.train_pattern))


def train_dataset(
    cfg: DataConfig,
    seq_len: int,
    vocab_size: int,
    seed: int,
    local_batch: int,
    process_index: int = 0,
    process_count: int = 1,
    start_example: int = 0,
) -> grain.MapDataset:
    """Local batches [local_batch, seq_len + 1] of the shuffled example stream from `start_example` (the
    examples earlier steps consumed, a multiple of process_count): element s feeds the s + 1-th step from there."""
    if start_example % process_count:
        raise DataError(f"start_example={start_example} does not split over {process_count} processes")
    windows = TokenWindows(find_shards(data_directory(cfg), cfg.train_pattern), seq_len, vocab_size)
    examples = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()[start_example:]
    return examples[process_index::process_count].batch(local_batch, drop_remainder=True)


def train_iterator(dataset: grain.MapDataset, cfg: DataConfig) -> grain.DatasetIterator:
    options = grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch)
    return iter(dataset.to_iter_dataset(options))


def validation_batches(
    cfg: DataConfig,
    seq_len: int,
    vocab_size: int,
    local_batch: int,
    batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[np.ndarray]:
    """The first `batches` batches of validation windows, in order (the same every evaluation)."""
    windows = TokenWindows(find_shards(data_directory(cfg), cfg.val_pattern), seq_len, vocab_size)
    examples = grain.MapDataset.source(windows)[process_index::process_count]
    available = len(examples) // local_batch
    if available == 0:
        raise DataError(
            f"the validation shards hold {len(windows)} windows of {seq_len + 1} tokens, fewer than one "
            f"batch of {local_batch * process_count}; add validation data or lower eval_batches"
        )
    batched = examples.batch(local_batch, drop_remainder=True)
    return [batched[i] for i in range(min(batches, available))]


def eval_windows(
    path: str | os.PathLike, seq_len: int, tokens: int, batch_size: int, process_index: int = 0, process_count: int = 1
) -> np.ndarray:
    """[windows, seq_len + 1] int32: the official evaluation's windows of one shard, a whole number of
    batches of `batch_size` covering at most `tokens` predicted tokens; of several processes', process p
    reads only rows p, p + P, ... of each batch (batch_size // P of them).

    The official eval_ppl.py reads a .bin file as uint16 from word 512 on (past the 1024-byte header),
    takes windows of seq_len + 1 tokens every seq_len tokens and evaluates
    floor(min(tokens, available) / (batch_size * seq_len)) batches of batch_size windows."""
    if batch_size % process_count:
        raise DataError(f"batch_size={batch_size} does not split over {process_count} processes")
    path = as_path(path)
    record = read_marker(path.parent)
    if record is not None and path.name in record["shards"]:  # a shard of a prepared folder: still as prepare wrote it
        verify_shards(path.parent, [path], record)
    data = open_shard(path)
    per_batch = batch_size * seq_len
    batches = max(min(tokens, data.size - 1), 0) // per_batch  # an empty file: no batch (named below)
    if batches == 0:
        raise DataError(
            f"{path} holds {data.size:,} tokens, fewer than one batch of {batch_size} windows of "
            f"{seq_len + 1} tokens ({per_batch + 1:,}); lower --batch_size or --seq_len, or use a "
            f"longer file"
        )
    count = batches * batch_size
    starts = np.arange(process_index, count, process_count) * seq_len
    return np.stack([np.asarray(data[s : s + seq_len + 1], dtype=np.int32) for s in starts])


def check_token_ids(
    windows: np.ndarray,
    path: str | os.PathLike,
    vocab_size: int,
    seq_len: int,
    process_index: int = 0,
    process_count: int = 1,
) -> None:
    """A DataError naming the file, the first token id >= vocab_size in `windows` (this process's rows of
    `eval_windows`) and its position in the file; an id out of range would index past the embedding (a NaN loss).
    Over several processes all of them raise (their largest ids are gathered first), so that none waits for the rest."""
    largest = int(windows.max(initial=0))
    if process_count > 1:
        from jax.experimental import multihost_utils

        largest = int(np.max(multihost_utils.process_allgather(np.int64(largest))))
    if largest < vocab_size:
        return
    rows, columns = np.nonzero(windows >= vocab_size)
    where = (
        f"token id {int(windows[rows[0], columns[0]])} at position "
        f"{(process_index + int(rows[0]) * process_count) * seq_len + int(columns[0])}"
        if rows.size
        else f"token id {largest}"
    )
    raise DataError(
        f"{path}: {where} is >= the model's vocabulary size {vocab_size} (ids 0 to {vocab_size - 1}); "
        f"the file was made with another tokenizer: evaluate a file tokenized for this model"
    )
