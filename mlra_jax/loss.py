"""Next-token cross-entropy over the tied head, computed with its gradients in one pass.

`next_token_loss_and_head` is what training differentiates: a custom VJP whose forward pass runs
the head, the loss and the loss's gradients with respect to the hidden states and the embedding
over chunks of positions, and whose backward pass only scales them by the incoming cotangent. So
the [B, T, V] float32 logits never exist at once (one chunk's at a time), and the head's matmul is
never recomputed: three matmuls per chunk (logits, d_hidden, d_embedding), as many as autodiff of
the whole logits would run. Called without differentiation (evaluation) it computes the loss only.
In training with model.fp8_head, some of those matmuls run in FP8 (mlra_jax.fp8_head).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from mlra_jax import fp8_head as fp8_head_gemms
from mlra_jax.layers import einsum
from mlra_jax.sharding import constrain_batch


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


def _chunks(hidden: jax.Array, targets: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """hidden [B, T, d] and targets [B, T] as [C, B, T / C, ...] chunks of `chunk` positions; one chunk
    when `chunk` is 0, at least T, or does not divide T."""
    batch, length, width = hidden.shape
    count = 1 if chunk <= 0 or chunk >= length or length % chunk else length // chunk
    return (
        hidden.reshape(batch, count, length // count, width).swapaxes(0, 1),
        targets.reshape(batch, count, length // count).swapaxes(0, 1),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def next_token_loss_and_head(
    hidden: jax.Array,
    embedding: jax.Array,
    targets: jax.Array,
    dtype: jnp.dtype,
    chunk: int,
    fp8_head: str = "off",
    cast_kernel: bool = False,
) -> jax.Array:
    """next_token_loss(head_logits(hidden, embedding, dtype), targets): hidden [B, T, d] (float32), the tied
    embedding [V, d], targets [B, T]; the head multiplied in `dtype` with float32 accumulation, over chunks
    of `chunk` positions (0: whole). Differentiated, its forward pass is _loss_forward's, where `fp8_head` puts
    some of the head's products in FP8; the loss alone (evaluation) multiplies in `dtype`."""
    del fp8_head, cast_kernel
    hidden_chunks, target_chunks = _chunks(hidden, targets, chunk)

    def body(total: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        h, t = inputs
        logits = constrain_batch(
            einsum("btd,vd->btv", h.astype(dtype), embedding.astype(dtype), preferred_element_type=jnp.float32)
        )
        return total + optax.softmax_cross_entropy_with_integer_labels(logits, t).sum(), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hidden_chunks, target_chunks))
    return total / targets.size


def _loss_forward(
    hidden: jax.Array,
    embedding: jax.Array,
    targets: jax.Array,
    dtype: jnp.dtype,
    chunk: int,
    fp8_head: str = "off",
    cast_kernel: bool = False,
):
    """The loss and, per chunk, its gradients: the logits' cotangent (softmax - one-hot) / (B T) rounded to
    `dtype` as under torch autocast, then d_hidden and d_embedding multiplied in `dtype` with float32
    accumulation; d_embedding summed over the chunks in float32. `fp8_head` "gradients": the two gradients'
    products in FP8, "all": the logits' too (mlra_jax.fp8_head; `cast_kernel`: the hidden states quantized on the
    FP8 cast kernel where it runs)."""
    hidden_chunks, target_chunks = _chunks(hidden, targets, chunk)
    scale = 1.0 / targets.size
    vocab = embedding.shape[0]
    compute_embedding = embedding.astype(dtype)
    if fp8_head != "off":
        embedding8, embedding8_t, e_scale = fp8_head_gemms.quantized_embedding(compute_embedding)
        scales = (fp8_head_gemms.hidden_scale(hidden.astype(dtype)), e_scale)

    def products(h: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], tuple[jax.Array, jax.Array]]]:
        """The chunk's float32 logits, and what turns (softmax - one-hot) into d_hidden and d_embedding."""
        if fp8_head == "off":
            logits = einsum("btd,vd->btv", h, compute_embedding, preferred_element_type=jnp.float32)

            def backward(g: jax.Array) -> tuple[jax.Array, jax.Array]:
                g = (g * scale).astype(dtype)
                return (
                    einsum("btv,vd->btd", g, compute_embedding, preferred_element_type=jnp.float32),
                    einsum("btv,btd->vd", g, h, preferred_element_type=jnp.float32),
                )

            return logits, backward
        batch, length, width = h.shape
        h8, h8_t = fp8_head_gemms.quantized_hidden(h.reshape(batch * length, width), scales[0], cast_kernel)
        if fp8_head == "all":
            logits = fp8_head_gemms.logits(h8, embedding8, scales, batch * length, vocab).reshape(batch, length, vocab)
        else:
            logits = einsum("btd,vd->btv", h, compute_embedding, preferred_element_type=jnp.float32)

        def backward(g: jax.Array) -> tuple[jax.Array, jax.Array]:
            g = g.reshape(batch * length, vocab)
            d_hidden, d_embedding = fp8_head_gemms.gradients(g, h8_t, embedding8_t, scales, scale, width, vocab)
            return d_hidden.reshape(batch, length, width), d_embedding

        return logits, backward

    def body(carry: tuple[jax.Array, jax.Array], inputs: tuple[jax.Array, jax.Array]):
        total, d_embedding = carry
        h, t = inputs
        logits, backward = products(h.astype(dtype))
        logits = constrain_batch(logits)
        log_norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)
        total = total + jnp.sum(log_norm - picked)
        probs = jnp.exp(logits - log_norm)
        d_hidden, d_chunk_embedding = backward(probs - jax.nn.one_hot(t, logits.shape[-1], dtype=probs.dtype))
        return (total, d_embedding + d_chunk_embedding), d_hidden

    start = (jnp.zeros((), jnp.float32), jnp.zeros(embedding.shape, jnp.float32))
    (total, d_embedding), d_hidden = jax.lax.scan(body, start, (hidden_chunks, target_chunks))
    d_hidden = d_hidden.swapaxes(0, 1).reshape(hidden.shape)
    residuals = (d_hidden.astype(hidden.dtype), d_embedding.astype(embedding.dtype), targets)
    return total * scale, residuals


def _loss_backward(
    dtype: jnp.dtype,
    chunk: int,
    fp8_head: str,
    cast_kernel: bool,
    residuals: tuple[jax.Array, jax.Array, jax.Array],
    cotangent: jax.Array,
):
    del dtype, chunk, fp8_head, cast_kernel
    d_hidden, d_embedding, targets = residuals
    zero_targets = jnp.zeros(targets.shape, jax.dtypes.float0)
    return (
        (cotangent * d_hidden).astype(d_hidden.dtype),
        (cotangent * d_embedding).astype(d_embedding.dtype),
        zero_targets,
    )


next_token_loss_and_head.defvjp(_loss_forward, _loss_backward)


def chunked_next_token_loss(
    hidden: jax.Array,
    embedding: jax.Array,
    targets: jax.Array,
    dtype: jnp.dtype,
    chunk: int,
    fp8_head: str = "off",
    cast_kernel: bool = False,
) -> jax.Array:
    """The training loss (next_token_loss_and_head): value and gradients are those of the whole form
    next_token_loss(head_logits(hidden, embedding, dtype), targets) up to float32 summation order, or with
    `fp8_head` "gradients" or "all" within FP8 rounding of them (mlra_jax.fp8_head; `cast_kernel`:
    fp8_casts.both_layouts's choice)."""
    return next_token_loss_and_head(hidden, embedding, targets, dtype, chunk, fp8_head, cast_kernel)
