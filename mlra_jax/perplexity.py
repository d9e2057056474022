"""Held-out loss and perplexity on llm.c token files, with the official evaluation's windows.

The windows are the official eval_ppl.py's (`data.pipeline.eval_windows`); with the same batch_size
both evaluate the same tokens. All windows have seq_len targets, so the mean of batch means (what
the official script reports) is the mean over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from mlra_jax.data.pipeline import eval_windows
from mlra_jax.model import Transformer
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


def batch_losses(model: Transformer, mesh: jax.sharding.Mesh, loss_chunk: int = 512
                 ) -> Callable[[np.ndarray], float]:
    """A function of a batch of windows -> its mean loss, data-parallel over the mesh."""
    graphdef, params = nnx.split(model)
    params = jax.device_put(nnx.to_pure_dict(params), replicated(mesh))
    step = jax.jit(lambda p, t: loss_fn(graphdef, p, t, loss_chunk),
                   in_shardings=(replicated(mesh), batch_sharding(mesh)))

    def evaluate(windows: np.ndarray) -> float:
        return float(step(params, jax.device_put(windows, batch_sharding(mesh))))

    return evaluate


def evaluate_set(name: str, path: str, evaluate: Callable[[np.ndarray], float], seq_len: int, tokens: int,
                 batch_size: int) -> SetResult:
    windows = eval_windows(path, seq_len, tokens, batch_size)
    losses = [evaluate(windows[i: i + batch_size])
              for i in tqdm(range(0, len(windows), batch_size), desc=name, unit="batch", leave=False)]
    loss = float(np.mean(losses))
    return SetResult(name, str(path), loss, math.exp(loss), len(windows), len(windows) * seq_len)
