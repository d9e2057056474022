"""The tied head's GEMMs in FP8 (`model.fp8_head`), inside the chunked cross-entropy (mlra_jax.loss).

Per chunk of positions the loss multiplies the hidden states h [M, d] by the embedding E [V, d] (the logits), the
logits' gradient G [M, V] by E (h's gradient) and G's transpose by h (E's gradient). `fp8_head="gradients"` runs the
last two as cuBLASLt FP8 GEMMs, "all" the three, each with both operands contracting over their last axis (the
layout Hopper's FP8 GEMMs take), as the projections' do (mlra_jax.fp8):
- E in e4m3, straight and transposed, once per step, scaled by its own amax;
- h in e4m3, straight and transposed, per chunk, scaled by the amax of the whole hidden state (one pass, before the
  chunks);
- G = softmax - one-hot lies in [-1, 1] whatever the logits, so it is quantized to e5m2 at a fixed scale (1 onto
  e5m2's largest value) with no amax; the loss's 1 / (B T) is applied to the products.
The scales are the tensors' own (dynamic scaling), so the head keeps no history in the train state. Products
accumulate in float32 and are written in float32, as the compute dtype's head writes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlra_jax import fp8, fp8_casts

# The head's GEMMs without cuBLASLt's fast accumulation: they sum over the vocabulary (h's gradient) and the tokens
# (E's), far longer than a projection's K
EXACT_SUMS = True
# G's fixed scale: |G| <= 1 maps onto e5m2's largest value (57344); below about 1e-9 it flushes to zero
GRADIENT_SCALE = 1.0 / fp8.MAX[fp8.E5M2]


def quantized_embedding(embedding: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(E8 [V', d'], E8 transposed [d', V'], its scale) of the embedding [V, d]: e4m3 by its own amax, padded with
    zeros to multiples of fp8.DIM_MULTIPLE. XLA's fusion makes both layouts (a weight, once per step)."""
    scale = fp8.scale_of(embedding, fp8.E4M3)
    quantized, quantized_t, _ = fp8_casts.both_layouts(embedding, 1.0 / scale, fp8.E4M3, fp8.DIM_MULTIPLE, kernel=False)
    return quantized, quantized_t, scale


def hidden_scale(hidden: jax.Array) -> jax.Array:
    """The e4m3 scale of the hidden states (all chunks'), from their amax."""
    return fp8.scale_of(hidden, fp8.E4M3)


def quantized_hidden(hidden: jax.Array, scale: jax.Array, cast_kernel: bool) -> tuple[jax.Array, jax.Array]:
    """(h8 [M', d'], h8 transposed [d', M']) of one chunk's hidden states [M, d] (the compute dtype) in e4m3 by
    `scale` (hidden_scale), padded with zeros to multiples of fp8.DIM_MULTIPLE; on the FP8 cast kernel where
    `cast_kernel` and the mesh allow (fp8_casts.both_layouts)."""
    h8, h8_t, _ = fp8_casts.both_layouts(hidden, 1.0 / scale, fp8.E4M3, fp8.DIM_MULTIPLE, cast_kernel)
    return h8, h8_t


def logits(
    hidden8: jax.Array, embedding8: jax.Array, scales: tuple[jax.Array, jax.Array], rows: int, vocab: int
) -> jax.Array:
    """float32 logits [rows, vocab] of one chunk's e4m3 hidden states (quantized_hidden) against E8
    (quantized_embedding of a [vocab, d] embedding). `scales`: (the hidden states', E's)."""
    h_scale, e_scale = scales
    product = fp8.gemm(hidden8, embedding8, h_scale * e_scale, jnp.float32, EXACT_SUMS)  # [M', d'] . [V', d']
    return product[:rows, :vocab]


def gradients(
    logits_gradient: jax.Array,
    hidden8_t: jax.Array,
    embedding8_t: jax.Array,
    scales: tuple[jax.Array, jax.Array],
    multiplier: float,
    width: int,
    vocab: int,
) -> tuple[jax.Array, jax.Array]:
    """float32 gradients of one chunk's hidden states [M, width] and of the embedding [vocab, width] for
    `multiplier` times G [M, vocab] (softmax - one-hot, float32), from the chunk's transposed e4m3 hidden states and
    E8 transposed (logits, quantized_embedding). `scales`: (the hidden states', E's)."""
    h_scale, e_scale = scales
    rows = logits_gradient.shape[0]
    g8, g8_t, _ = fp8_casts.both_layouts(
        logits_gradient, jnp.float32(1.0 / GRADIENT_SCALE), fp8.E5M2, fp8.DIM_MULTIPLE, kernel=False
    )
    g_scale = GRADIENT_SCALE * multiplier
    d_hidden = fp8.gemm(g8, embedding8_t, g_scale * e_scale, jnp.float32, EXACT_SUMS)  # [M', V'] . [d', V']
    d_embedding = fp8.gemm(g8_t, hidden8_t, g_scale * h_scale, jnp.float32, EXACT_SUMS)  # [V', M'] . [d', M']
    return d_hidden[:rows, :width], d_embedding[:vocab, :width]


def describe(matmul_dtype: str, fp8_head: str, device: jax.Device | None = None) -> str:
    """One line on how a train step's tied head multiplies on `device` (for --dry_run), with model.fp8_head
    `fp8_head`."""
    if matmul_dtype != "float8":
        return "tied head: the compute dtype"
    if fp8_head == "off":
        return "tied head: the compute dtype (model.fp8_head=off)"
    device = device or jax.devices()[0]
    if not fp8.supported(device):
        return f"tied head: the compute dtype ({device.device_kind} has no FP8 GEMMs)"
    which = {"gradients": "its two gradients' GEMMs", "all": "the logits' and its two gradients' GEMMs"}[fp8_head]
    return (
        f"tied head: {which} in FP8 (e4m3 hidden states and embedding scaled by their own amaxes, the logits' "
        "gradient in e5m2 at a fixed scale)"
    )
