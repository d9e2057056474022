"""Log-probabilities of continuations: batches padded to a few shapes, scored on device.

    scorer = ContinuationScorer(model, batch_size=32, max_length=2048)
    scorer.score([[50256, 464, 3290, 318]], [2])   # [(log p(last 2 tokens | the rest), is_greedy)]

Each sequence is context + continuation (at most max_length + 1 tokens); the model reads all but
its last token, and the continuation's tokens are scored at the positions that predict them.
Rows are right-padded: the model is causal, so the padding after a row's tokens never reaches
them, and every row keeps positions 0, 1, ... as in training. Batches are filled to `batch_size`
rows and lengths rounded up to a power of two (at least `min_length`, at most max_length), so jit
compiles about log2(max_length / min_length) + 1 programs. The [B, T, V] logits never leave the
device: each chunk of positions returns only its targets' log-probabilities and greedy matches.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlra_jax.loss import head_logits
from mlra_jax.model import Transformer
from mlra_jax.params import params_for_compute
from mlra_jax.sharding import batch_sharding, data_parallel_size, replicated

POSITION_CHUNK = 256  # positions whose [B, chunk, V] logits are held at once


def length_buckets(max_length: int, min_length: int = 16) -> tuple[int, ...]:
    """Powers of two from min_length below max_length, then max_length itself."""
    buckets, length = [], min_length
    while length < max_length:
        buckets.append(length)
        length *= 2
    return (*buckets, max_length)


@functools.partial(jax.jit, static_argnums=0)
def target_log_probs(
    graphdef: nnx.GraphDef, params: dict, inputs: jax.Array, targets: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(log p(targets[b, t] | inputs[b, :t + 1]), targets[b, t] == argmax) for inputs, targets [B, T];
    jitted once per model structure and shape (the arrays' shardings, data-parallel or not, carry over)."""
    dtype = nnx.merge(graphdef, params).config.dtype
    model = nnx.merge(graphdef, params_for_compute(params, dtype))
    hidden, embedding = model.hidden(inputs), model.embed.embedding[...]

    def score(h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        log_probs = jax.nn.log_softmax(head_logits(h, embedding, dtype), axis=-1)
        picked = jnp.take_along_axis(log_probs, t[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(log_probs, axis=-1) == t

    batch, length, width = hidden.shape
    if length <= POSITION_CHUNK or length % POSITION_CHUNK:
        return score(hidden, targets)
    chunks = length // POSITION_CHUNK
    picked, greedy = jax.lax.map(
        lambda x: score(*x),
        (
            hidden.reshape(batch, chunks, POSITION_CHUNK, width).swapaxes(0, 1),
            targets.reshape(batch, chunks, POSITION_CHUNK).swapaxes(0, 1),
        ),
    )
    return picked.swapaxes(0, 1).reshape(batch, length), greedy.swapaxes(0, 1).reshape(batch, length)


class ContinuationScorer:
    """Scores batches of token sequences with one model; data-parallel over `mesh` when given."""

    def __init__(
        self,
        model: Transformer,
        batch_size: int,
        max_length: int,
        mesh: jax.sharding.Mesh | None = None,
        min_length: int = 16,
    ):
        if mesh is not None and batch_size % data_parallel_size(mesh):
            raise ValueError(
                f"batch_size={batch_size} is not a multiple of the {data_parallel_size(mesh)} data-parallel devices"
            )
        self.batch_size, self.max_length, self.mesh = batch_size, max_length, mesh
        self.buckets = length_buckets(max_length, min(min_length, max_length))
        self._graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self._params = params if mesh is None else jax.device_put(params, replicated(mesh))
        self._batch = None if mesh is None else batch_sharding(mesh)

    def padded_length(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def score(
        self, sequences: Sequence[Sequence[int]], continuation_lengths: Sequence[int]
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per sequence;
        at most batch_size sequences of 2 to max_length + 1 tokens."""
        if not 0 < len(sequences) <= self.batch_size:
            raise ValueError(f"{len(sequences)} sequences for a batch of {self.batch_size}")
        lengths = [len(s) - 1 for s in sequences]  # model inputs
        if min(lengths) < 1 or max(lengths) > self.max_length:
            raise ValueError(
                f"sequences must hold 2 to {self.max_length + 1} tokens (got {min(lengths) + 1} to {max(lengths) + 1})"
            )
        width = self.padded_length(max(lengths))
        tokens = np.zeros((self.batch_size, width + 1), np.int32)
        for row, sequence in enumerate(sequences):
            tokens[row, : len(sequence)] = sequence
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if self._batch is not None:
            inputs, targets = jax.device_put(inputs, self._batch), jax.device_put(targets, self._batch)
        picked, greedy = (np.asarray(x) for x in target_log_probs(self._graphdef, self._params, inputs, targets))
        results = []
        for row, (length, count) in enumerate(zip(lengths, continuation_lengths)):
            if not 0 < count <= length:
                raise ValueError(f"continuation of {count} tokens in a sequence of {length + 1}")
            span = slice(length - count, length)
            results.append((float(picked[row, span].astype(np.float64).sum()), bool(greedy[row, span].all())))
        return results
