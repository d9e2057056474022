"""Latent decode attention as a Pallas Mosaic TPU kernel (also run in TPU interpret mode on CPU).

Same contract as latent_decode_reference.reference, on a contiguous or a paged cache.

The kernel reads the RoPE key with the slots minor ([.., Dr, slots] tiles): the TPU compiler stores a cache of
[B, S, 1, Dr] (Dr = 64, narrower than a vreg's 128 lanes) with the slots minor, where the key's transpose is a
bitcast. Tiles of [.., slots, Dr] would have XLA copy every layer's RoPE-key cache into their layout on every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mlra_jax.pallas_kernels.latent_decode_common import LOG2E, check_page_table, choose_splits, combine


def latent_decode_tpu(
    q_rope: jax.Array,
    q_latent: jax.Array,
    k_rope: jax.Array,
    latent: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    *,
    scale: float,
    block_kv: int = 128,
    splits: int | None = None,
    page_table: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Pallas Mosaic TPU kernel; shapes as `reference`, or a paged cache with its `page_table` (then a KV
    block is one page). The grid walks (batch, block, split, kv block); KV blocks outside a sequence's range
    are neither fetched (their index is clamped) nor computed."""
    b, n, h, dr = q_rope.shape
    r = latent.shape[-1]
    paged = page_table is not None
    if paged:
        block_kv = check_page_table(k_rope, latent, page_table, b)
        s = page_table.shape[1] * block_kv
    else:
        s = latent.shape[1]
        page_table = jnp.zeros((1, 1), jnp.int32)  # unused
    splits = splits or choose_splits(b * n, s, block_kv, cores=2)
    steps = pl.cdiv(pl.cdiv(s, block_kv), splits)  # KV blocks per split
    if paged:
        latent = latent.reshape(latent.shape[0], block_kv, n * r)
    else:
        padded = splits * steps * block_kv
        if padded != s:  # whole blocks only; padding is masked
            k_rope = jnp.pad(k_rope, ((0, 0), (0, padded - s), (0, 0)))
            latent = jnp.pad(latent, ((0, 0), (0, padded - s), (0, 0), (0, 0)))
        latent = latent.reshape(b, padded, n * r)
    k_rope_t = jnp.swapaxes(k_rope, 1, 2)  # [.., Dr, slots]: the stored layout's bitcast on TPUs

    def kv_block(bi, split, step, starts_ref, ends_ref, pages_ref):
        """(the cache's leading index, the block along its slots) of a sequence's step-th block in a split."""
        first, last = starts_ref[bi] // block_kv, jnp.maximum(ends_ref[bi] - 1, 0) // block_kv
        block = jnp.clip(split * steps + step, first, last)
        return (pages_ref[bi, block], 0) if paged else (bi, block)

    def rope_block(lead, block):
        """The transposed RoPE key's block index of the latent's (lead, block)."""
        return lead, 0, block

    def kernel(
        starts_ref, ends_ref, pages_ref, q_rope_ref, q_lat_ref, k_rope_ref, lat_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc
    ):
        bi, split, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
        start, end = starts_ref[bi], ends_ref[bi]
        block = split * steps + step

        @pl.when(step == 0)
        def _init():
            m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        @pl.when((block * block_kv < end) & ((block + 1) * block_kv > start))
        def _compute():
            rope = jnp.dot(q_rope_ref[0, 0], k_rope_ref[0], preferred_element_type=jnp.float32)  # [h, block_kv]
            dims = (((1,), (1,)), ((), ()))
            logits = rope + jax.lax.dot_general(q_lat_ref[0, 0], lat_ref[0], dims, preferred_element_type=jnp.float32)
            slots = block * block_kv + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            logits = jnp.where((slots >= start) & (slots < end), logits * (scale * LOG2E), -jnp.inf)
            m_new = jnp.maximum(m_sc[...], logits.max(axis=1, keepdims=True))
            alpha = jnp.exp2(m_sc[...] - m_new)
            p = jnp.exp2(logits - m_new)
            l_sc[...] = alpha * l_sc[...] + p.sum(axis=1, keepdims=True)
            acc_sc[...] = alpha * acc_sc[...] + jnp.dot(
                p.astype(lat_ref.dtype), lat_ref[0], preferred_element_type=jnp.float32
            )
            m_sc[...] = m_new

        @pl.when(step == steps - 1)
        def _finish():
            total = l_sc[...]
            o_ref[0, 0, 0] = jnp.where(total > 0, acc_sc[...] / jnp.where(total > 0, total, 1.0), 0.0)
            lse_ref[0, 0, 0] = (m_sc[...] + jnp.log2(jnp.where(total > 0, total, 1.0))).reshape(1, h)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, n, splits, steps),
        in_specs=[
            pl.BlockSpec((1, 1, h, dr), lambda bi, ni, sp, st, *_: (bi, ni, 0, 0)),
            pl.BlockSpec((1, 1, h, r), lambda bi, ni, sp, st, *_: (bi, ni, 0, 0)),
            pl.BlockSpec((1, dr, block_kv), lambda bi, ni, sp, st, *refs: rope_block(*kv_block(bi, sp, st, *refs))),
            pl.BlockSpec((1, block_kv, r), lambda bi, ni, sp, st, *refs: (*kv_block(bi, sp, st, *refs), ni)),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, 1, h, r), lambda bi, ni, sp, st, *_: (bi, ni, sp, 0, 0)),
            pl.BlockSpec((1, 1, 1, 1, h), lambda bi, ni, sp, st, *_: (bi, ni, sp, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, r), jnp.float32),
        ],
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        name="latent_decode_tpu",
        out_shape=[
            jax.ShapeDtypeStruct((b, n, splits, h, r), jnp.float32),
            jax.ShapeDtypeStruct((b, n, splits, 1, h), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        starts.astype(jnp.int32),
        ends.astype(jnp.int32),
        page_table.astype(jnp.int32),
        q_rope,
        q_latent,
        k_rope_t,
        latent,
    )
    return combine(out, lse[:, :, :, 0], latent.dtype)
