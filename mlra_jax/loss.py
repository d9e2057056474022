"""Next-token cross-entropy over the tied head, whole or in sequence chunks.

The chunked form never holds the [B, T, V] float32 logits at once: it scans over chunks
of positions, and each chunk's logits are recomputed in the backward pass
(`jax.checkpoint`), so memory holds one chunk's. Value and gradients are those of the
whole form up to float32 summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from mlra_jax.layers import einsum


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy in float32 of logits [B, T, V] against targets [B, T]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def head_logits(hidden: jax.Array, embedding: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Float32 logits of hidden [B, T, d] against the tied embedding [V, d], multiplied in the compute dtype.

    The backward multiplies in the compute dtype too (the logits' cotangent rounded to it, as under
    torch autocast, whose logits are bf16), with float32 accumulation and float32 gradients; left
    to autodiff, the float32 cotangent would make both backward matmuls float32 (TF32 on GPUs)."""
    return einsum("btd,vd->btv", hidden.astype(dtype), embedding.astype(dtype), preferred_element_type=jnp.float32)


def _head_forward(hidden: jax.Array, embedding: jax.Array, dtype: jnp.dtype):
    return head_logits(hidden, embedding, dtype), (hidden, embedding)


def _head_backward(dtype: jnp.dtype, residuals: tuple[jax.Array, jax.Array], cotangent: jax.Array):
    hidden, embedding = residuals
    cotangent = cotangent.astype(dtype)
    d_hidden = einsum("btv,vd->btd", cotangent, embedding.astype(dtype), preferred_element_type=jnp.float32)
    d_embedding = einsum("btv,btd->vd", cotangent, hidden.astype(dtype), preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_embedding.astype(embedding.dtype)


head_logits.defvjp(_head_forward, _head_backward)


def chunked_next_token_loss(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, dtype: jnp.dtype,
                            chunk: int) -> jax.Array:
    """next_token_loss(head_logits(hidden, embedding), targets) over chunks of `chunk` positions.

    The embedding enters each chunk in its own dtype (float32 parameters), so its gradient
    sums over the chunks in float32. A sequence that `chunk` does not divide, or a chunk of
    0 or at least the sequence, takes the whole form."""
    batch, length, width = hidden.shape
    if chunk <= 0 or chunk >= length or length % chunk:
        return next_token_loss(head_logits(hidden, embedding, dtype), targets)
    chunks = length // chunk
    hidden = hidden.reshape(batch, chunks, chunk, width).swapaxes(0, 1)
    targets = targets.reshape(batch, chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_loss(h: jax.Array, t: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(head_logits(h, embedding, dtype), t).sum()

    def body(total: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return total + chunk_loss(*inputs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hidden, targets))
    return total / (batch * length)
