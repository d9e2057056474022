"""Held-out loss and perplexity on llm.c token files, with the official evaluation's windows.

The windows are the official eval_ppl.py's (`data.pipeline.eval_windows`); with the same batch_size
both evaluate the same tokens. All windows have seq_len targets, so the mean of batch means (what
the official script reports) is the mean over tokens. Over several processes each reads only its rows
of every batch (`eval_windows`), and the batch mean is taken on the global array, across hosts. A file is
checked as training checks its shards (llm.c header and size by `open_shard`; every token id read below the
model's vocabulary: `check_token_ids`) before any window is evaluated, and a loss that is not finite is an error,
never a result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from mlra_jax.data.pipeline import check_token_ids, eval_windows
from mlra_jax.data.shards import DataError, open_shard
from mlra_jax.guards import InputError
from mlra_jax.model import Transformer
from mlra_jax.paths import as_path
from mlra_jax.progress import bars_drawn
from mlra_jax.sharding import batch_sharding, replicated
from mlra_jax.training.step import loss_fn


@dataclass(frozen=True)
class SetResult:
    name: str
    path: str
    loss: float
    perplexity: float
    windows: int
    tokens: int  # predicted tokens


def batch_losses(model: Transformer, mesh: jax.sharding.Mesh, loss_chunk: int = 512) -> Callable[[np.ndarray], float]:
    """A function of this process's rows of a batch of windows -> the whole batch's mean loss, data-parallel
    over the mesh (which may span several processes; every process calls it with its rows)."""
    graphdef, params = nnx.split(model)
    params = jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(replicated(mesh), np.asarray(a)), nnx.to_pure_dict(params)
    )
    step = jax.jit(
        lambda p, t: loss_fn(graphdef, p, t, loss_chunk),
        in_shardings=(replicated(mesh), batch_sharding(mesh)),
        out_shardings=replicated(mesh),
    )

    def evaluate(local_windows: np.ndarray) -> float:
        loss = step(params, jax.make_array_from_process_local_data(batch_sharding(mesh), local_windows))
        return float(loss.addressable_data(0))

    return evaluate


def evaluate_set(
    name: str,
    path: str,
    evaluate: Callable[[np.ndarray], float],
    seq_len: int,
    tokens: int,
    batch_size: int,
    vocab_size: int,
) -> SetResult:
    """One set's result; every process calls it, reading its own rows of each batch of batch_size windows
    (their token ids checked against `vocab_size` first)."""
    processes = jax.process_count()
    available = open_shard(as_path(path)).size  # header and size checked; an empty file ends here, not in a traceback
    if available - 1 < batch_size * seq_len:
        raise DataError(
            f"{path} holds {available:,} tokens, fewer than one batch of {batch_size} windows of "
            f"{seq_len + 1} tokens ({batch_size * seq_len + 1:,}); lower --batch_size or --seq_len, or "
            f"use a longer file"
        )
    windows = eval_windows(path, seq_len, tokens, batch_size, jax.process_index(), processes)
    check_token_ids(windows, path, vocab_size, seq_len, jax.process_index(), processes)
    rows = batch_size // processes
    losses = [
        evaluate(windows[i : i + rows])
        for i in tqdm(
            range(0, len(windows), rows),
            desc=name,
            unit="batch",
            leave=False,
            disable=jax.process_index() > 0 or not bars_drawn(),
        )
    ]
    loss, count = float(np.mean(losses)), len(windows) * processes
    if not math.isfinite(loss):
        raise InputError(
            f"the loss on {name} ({path}) is {loss}, not a number a result can hold; nothing was "
            f"written. Evaluate in float32 (--dtype float32), or check the checkpoint"
        )
    perplexity = math.exp(loss) if loss < 709 else math.inf  # beyond: more than a float holds (JSON: null)
    return SetResult(name, str(path), loss, perplexity, count, count * seq_len)
