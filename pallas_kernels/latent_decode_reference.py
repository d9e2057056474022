"""The definition of latent decode attention in plain jnp, which the kernels are tested against.

One query token per sequence; per latent block n the H heads attend MQA-style with
    q = [q_rope || q_latent],  k = [k_rope || latent_n],  v = latent_n        (paper Step 2)
over the slots [start_b, end_b) of sequence b (left padding before start_b).

The cache is contiguous (k_rope [B, S, Dr], latent [B, S, N, R]) or paged: pages of
`page` slots shared by all sequences (k_rope [P, page, Dr], latent [P, page, N, R]) and a
page table [B, S / page] naming the page that holds each sequence's slots
[i * page, (i + 1) * page) (`gather_pages` turns it back into the contiguous cache).
Slots outside the ranges must hold finite values (a zero-initialized cache does): they are
masked out of the softmax but still multiply a zero probability.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference(
    q_rope: jax.Array,
    q_latent: jax.Array,
    k_rope: jax.Array,
    latent: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """q_rope [B, N, H, Dr], q_latent [B, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R] -> [B, N, H, R]."""
    f32 = jnp.float32
    logits = (
        jnp.einsum("bnhr,bsnr->bnhs", q_latent.astype(f32), latent.astype(f32))
        + jnp.einsum("bnhk,bsk->bnhs", q_rope.astype(f32), k_rope.astype(f32))
    ) * scale
    slots = jnp.arange(latent.shape[1])
    valid = (slots[None] >= starts[:, None]) & (slots[None] < ends[:, None])
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    out = jnp.einsum("bnhs,bsnr->bnhr", jax.nn.softmax(logits, axis=-1), latent.astype(f32))
    return out.astype(latent.dtype)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """A paged cache [P, page, ...] and a page table [B, pages] -> the contiguous cache [B, pages * page, ...]."""
    return pages[page_table].reshape(page_table.shape[0], -1, *pages.shape[2:])
