"""Decode attention over a shared latent cache with a separate RoPE key (MLA, GLA, MLRA).

One query token per sequence; per latent block n the H heads attend MQA-style with
    q = [q_rope || q_latent],  k = [k_rope || latent_n],  v = latent_n        (paper Step 2)
over the slots [start_b, end_b) of sequence b (left padding before start_b).

The cache is contiguous (k_rope [B, S, Dr], latent [B, S, N, R]) or paged: pages of
`page` slots shared by all sequences (k_rope [P, page, Dr], latent [P, page, N, R]) and a
page table [B, S / page] naming the page that holds each sequence's slots
[i * page, (i + 1) * page) (`gather_pages` turns it back into the contiguous cache).
Slots outside the ranges must hold finite values (a zero-initialized cache does): they are
masked out of the softmax but still multiply a zero probability.

Split-KV (flash-decoding): each sequence's range is cut into `splits` pieces handled
by different programs, each returning its normalized partial output and log2-sum-exp;
`combine` merges them. Implementations:
  * `reference`            plain jnp, the definition the kernels are tested against;
  * `latent_decode_tpu`    Pallas Mosaic TPU (also run in TPU interpret mode on CPU);
  * `latent_decode_gpu`    Pallas Mosaic GPU for Hopper (pallas_kernels/latent_decode_gpu.py), whose
                           split-KV merge is a Mosaic GPU kernel too (`combine_gpu`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LOG2E = math.log2(math.e)


def reference(q_rope: jax.Array, q_latent: jax.Array, k_rope: jax.Array, latent: jax.Array, starts: jax.Array,
              ends: jax.Array, *, scale: float) -> jax.Array:
    """q_rope [B, N, H, Dr], q_latent [B, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R] -> [B, N, H, R]."""
    f32 = jnp.float32
    logits = (jnp.einsum("bnhr,bsnr->bnhs", q_latent.astype(f32), latent.astype(f32))
              + jnp.einsum("bnhk,bsk->bnhs", q_rope.astype(f32), k_rope.astype(f32))) * scale
    slots = jnp.arange(latent.shape[1])
    valid = (slots[None] >= starts[:, None]) & (slots[None] < ends[:, None])
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    out = jnp.einsum("bnhs,bsnr->bnhr", jax.nn.softmax(logits, axis=-1), latent.astype(f32))
    return out.astype(latent.dtype)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """A paged cache [P, page, ...] and a page table [B, pages] -> the contiguous cache [B, pages * page, ...]."""
    return pages[page_table].reshape(page_table.shape[0], -1, *pages.shape[2:])


def check_page_table(k_rope: jax.Array, latent: jax.Array, page_table: jax.Array, batch: int) -> int:
    """The page size of a paged cache, or a ValueError that names the mismatch."""
    if k_rope.ndim != 3 or latent.ndim != 4 or k_rope.shape[:2] != latent.shape[:2]:
        raise ValueError(f"a paged cache is k_rope [pages, page, Dr] and latent [pages, page, N, R] with the same "
                         f"pages; got {k_rope.shape} and {latent.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"the page table must be integer [batch={batch}, pages per sequence]; got "
                         f"{page_table.dtype} {page_table.shape}")
    return k_rope.shape[1]


def combine(partial_out: jax.Array, partial_lse2: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Merge split-KV partials: out [..., splits, H, R] (each normalized), lse2 [..., splits, H] (log2).

    The TPU kernel's merge, and the definition that `latent_decode_gpu.combine_gpu` (one kernel) is tested
    against. Written for few kernels: the max over the small lse array, then one add-only variadic
    reduction of the weighted outputs and of the weights (7.5 us on an H100 for MLRA-4's 132 partials,
    against 8.6 us for a softmax over the splits and a weighted sum)."""
    axis = partial_out.ndim - 3
    if partial_out.shape[axis] == 1:
        return jnp.squeeze(partial_out, axis).astype(dtype)
    f32 = jnp.float32
    lse2 = partial_lse2.astype(f32)
    top = jnp.max(lse2, axis=axis, keepdims=True)
    weights = jnp.exp2(lse2 - jnp.where(jnp.isfinite(top), top, 0.0))[..., None]  # empty splits weigh 0
    weighted, total = jax.lax.reduce(
        (weights * partial_out.astype(f32), jnp.broadcast_to(weights, partial_out.shape)),
        (jnp.array(0.0, f32), jnp.array(0.0, f32)), lambda a, b: (a[0] + b[0], a[1] + b[1]), (axis,))
    return (weighted / jnp.where(total > 0, total, 1.0)).astype(dtype)


def ranges_from_mask(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) [B] of the contiguous valid slots of a decode mask [B, 1, S] or [B, S].

    One fused sum/max reduction (an argmax over a long cache costs tens of microseconds on GPUs)."""
    valid = mask.reshape(mask.shape[0], -1)
    ends = jnp.max(jnp.where(valid, jnp.arange(1, valid.shape[1] + 1, dtype=jnp.int32), 0), axis=-1)
    return ends - jnp.sum(valid, axis=-1, dtype=jnp.int32), ends


def choose_splits(batch_programs: int, max_len: int, block_kv: int, cores: int) -> int:
    """Enough programs to fill `cores`, at least one KV block each."""
    return max(1, min(cores // max(batch_programs, 1), pl.cdiv(max_len, block_kv)))


# ----------------------------------------------------------------------------- TPU
def latent_decode_tpu(q_rope: jax.Array, q_latent: jax.Array, k_rope: jax.Array, latent: jax.Array,
                      starts: jax.Array, ends: jax.Array, *, scale: float, block_kv: int = 128,
                      splits: int | None = None, page_table: jax.Array | None = None,
                      interpret: bool = False) -> jax.Array:
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

    def kv_block(bi, split, step, starts_ref, ends_ref, pages_ref):
        """(the cache's leading index, the block along its slots) of a sequence's step-th block in a split."""
        first, last = starts_ref[bi] // block_kv, jnp.maximum(ends_ref[bi] - 1, 0) // block_kv
        block = jnp.clip(split * steps + step, first, last)
        return (pages_ref[bi, block], 0) if paged else (bi, block)

    def kernel(starts_ref, ends_ref, pages_ref, q_rope_ref, q_lat_ref, k_rope_ref, lat_ref, o_ref, lse_ref, m_sc,
               l_sc, acc_sc):
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
            dims = (((1,), (1,)), ((), ()))
            logits = (jax.lax.dot_general(q_rope_ref[0, 0], k_rope_ref[0], dims, preferred_element_type=jnp.float32)
                      + jax.lax.dot_general(q_lat_ref[0, 0], lat_ref[0], dims, preferred_element_type=jnp.float32))
            slots = block * block_kv + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            logits = jnp.where((slots >= start) & (slots < end), logits * (scale * LOG2E), -jnp.inf)
            m_new = jnp.maximum(m_sc[...], logits.max(axis=1, keepdims=True))
            alpha = jnp.exp2(m_sc[...] - m_new)
            p = jnp.exp2(logits - m_new)
            l_sc[...] = alpha * l_sc[...] + p.sum(axis=1, keepdims=True)
            acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p.astype(lat_ref.dtype), lat_ref[0],
                                                        preferred_element_type=jnp.float32)
            m_sc[...] = m_new

        @pl.when(step == steps - 1)
        def _finish():
            l = l_sc[...]
            o_ref[0, 0, 0] = jnp.where(l > 0, acc_sc[...] / jnp.where(l > 0, l, 1.0), 0.0)
            lse_ref[0, 0, 0] = (m_sc[...] + jnp.log2(jnp.where(l > 0, l, 1.0))).reshape(1, h)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, n, splits, steps),
        in_specs=[
            pl.BlockSpec((1, 1, h, dr), lambda bi, ni, sp, st, *_: (bi, ni, 0, 0)),
            pl.BlockSpec((1, 1, h, r), lambda bi, ni, sp, st, *_: (bi, ni, 0, 0)),
            pl.BlockSpec((1, block_kv, dr), lambda bi, ni, sp, st, *refs: (*kv_block(bi, sp, st, *refs), 0)),
            pl.BlockSpec((1, block_kv, r), lambda bi, ni, sp, st, *refs: (*kv_block(bi, sp, st, *refs), ni)),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, 1, h, r), lambda bi, ni, sp, st, *_: (bi, ni, sp, 0, 0)),
            pl.BlockSpec((1, 1, 1, 1, h), lambda bi, ni, sp, st, *_: (bi, ni, sp, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                        pltpu.VMEM((h, r), jnp.float32)],
    )
    out, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, n, splits, h, r), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, splits, 1, h), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), page_table.astype(jnp.int32), q_rope, q_latent, k_rope, latent)
    return combine(out, lse[:, :, :, 0], latent.dtype)


# ----------------------------------------------------------------------------- dispatch
def kernel_for_backend():
    """The kernel for the default backend (GPU: Mosaic GPU, TPU: Mosaic TPU)."""
    backend = jax.default_backend()
    if backend == "gpu":
        from pallas_kernels.latent_decode_gpu import latent_decode_gpu

        return latent_decode_gpu
    if backend == "tpu":
        return latent_decode_tpu
    raise ValueError(f"attention_impl='pallas' needs a GPU or TPU; the backend is {backend!r} (the kernels run on "
                     f"CPU only in the tests' interpret mode); use attention_impl='xla'")


def _automatic_batch_axes() -> tuple[str, ...]:
    """Data-parallel mesh axes still under GSPMD here (a kernel cannot be partitioned by it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = jax.sharding.AxisType.Manual
    return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                 if name in ("data", "fsdp") and kind != manual and mesh.shape[name] > 1)


def latent_decode_attention(q_rope: jax.Array, q_latent: jax.Array, k_rope: jax.Array, latent: jax.Array, *,
                            scale: float, mask: jax.Array) -> jax.Array:
    """The model's entry point (attention.core.latent_attention, impl='pallas'): one decode token.

    q_rope [B, 1, N, H, Dr], q_latent [B, 1, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R],
    mask [B, 1, S] (a contiguous range per sequence) -> [B, 1, N, H, R]. Under a mesh, each
    data-parallel shard of the batch runs the kernel on its own sequences."""
    if q_rope.shape[1] != 1:
        raise ValueError(f"the Pallas latent kernel decodes one token at a time; got {q_rope.shape[1]} (prefill "
                         f"runs unabsorbed on XLA)")
    kernel = kernel_for_backend()
    starts, ends = ranges_from_mask(mask)

    def run(q_rope, q_latent, k_rope, latent, starts, ends):
        return kernel(q_rope, q_latent, k_rope, latent, starts, ends, scale=scale)

    axes = _automatic_batch_axes()
    mesh = jax.sharding.get_abstract_mesh()
    in_tp_region = not mesh.empty and jax.sharding.AxisType.Manual in mesh.axis_types
    if axes and in_tp_region and jax.default_backend() == "gpu":
        # Seen on 8 x H200 (jax 0.11.2): XLA aborts compiling a Mosaic GPU kernel in a data-parallel
        # shard_map nested in the tensor-parallel one. TP alone and DP alone are the supported layouts.
        raise ValueError("attention_impl='pallas' on GPUs supports tensor parallelism or data parallelism, not both "
                         "at once (XLA fails to compile the nested kernel); set mesh.data=1 or use "
                         "attention_impl='xla'")
    if axes:
        shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
        if q_rope.shape[0] % shards:
            raise ValueError(f"a batch of {q_rope.shape[0]} cannot be split over the {shards} data-parallel devices "
                             f"{axes}; use a batch that is a multiple of {shards}")
        batch = jax.sharding.PartitionSpec(axes)
        run = jax.shard_map(run, in_specs=(batch,) * 6, out_specs=batch, axis_names=set(axes), check_vma=False)
    return run(q_rope[:, 0], q_latent[:, 0], k_rope, latent, starts, ends)[:, None]


__all__ = ["check_page_table", "combine", "gather_pages", "kernel_for_backend", "latent_decode_attention", "latent_decode_tpu", "ranges_from_mask",
           "reference"]
