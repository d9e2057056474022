"""MLRA's causal attention backward in one Mosaic GPU kernel: mlra_attention_gpu_backward's dK/dV kernel that also
accumulates dQ (FlashAttention-3's backward), in place of the separate dQ kernel that recomputes S and dP.

A CTA takes one (latent block, 128 keys, sequence) as the dK/dV kernel does, and walks every query head of its block
over the query tiles of 64 from its diagonal on. Per tile, each of the two compute warpgroups (64 keys each) computes
S^T, dP^T, P^T and dS^T, stores dS^T (the inputs' dtype) into SMEM and adds P^T dO, dS^T q_latent and dS^T q_rope onto
its key-side accumulators. Once both warpgroups' dS^T are stored (a barrier per tile, two SMEM buffers in turn), the
tile's dQ = dS [latent || k_rope] over the CTA's 128 keys is split by columns of 64: chunk c of [R latent || Dr RoPE]
columns is warpgroup c mod 2's, computed with dS read transposed from SMEM, staged in float32 SMEM and added into
float32 accumulators in global memory by TMA reductions (reduce-add). d q_latent [G H, B, T, n, R] is one
accumulator per branch; d q_rope [B, T, G H, Dr] one for all branches, which therefore need no sum afterwards.

The accumulators start at zero: they enter as inputs aliased to the outputs, which Pallas's mpmd_map takes
(`plgpu.kernel` has no input_output_aliases). Interpret mode (CPU) has no TMA reductions; there each warpgroup adds
its staged chunks into the accumulators itself (the warpgroups' columns are disjoint, and the CTAs run in turn).

MMA work per (query, key, head): 832 units against the split backward's 1,152 (S and dP are not recomputed). SMEM:
both key tiles, two stages of query tiles, two dS^T buffers and the float32 staging of dQ's chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.pallas import mpmd
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from mlra_jax.pallas_kernels.gpu_interpret import interpret_params
from mlra_jax.pallas_kernels.mlra_attention_gpu import CHUNK, COMPUTE_WGS, LOG2E, stream_tiles
from mlra_jax.pallas_kernels.mlra_backward_parts import (
    TILE,
    Reg,
    TransposedA,
    iota,
    mma,
    smem_transforms,
    stages_that_fit,
    vector,
    zeros_tile,
)


def _reduce_add(staged, accumulator, interpret: bool) -> None:
    """accumulator += staged (float32, SMEM into global memory): a TMA reduction on the GPU."""
    if interpret:
        accumulator[...] = accumulator[...] + staged[...]
    else:
        plgpu.copy_smem_to_gmem(staged, accumulator, reduction_op="add")


def dkv_dq(
    ql,
    qr,
    lat,
    kr,
    do,
    lse2,
    delta,
    *,
    scale: float,
    groups: int,
    stages: int | None,
    interpret: bool,
    head_splits: int = 1,
):
    """(d latent [P, B, S, n G, R] and d k_rope [P, B, n G, S, Dr] per part (to be summed over the parts and, for
    d k_rope, the blocks), d q_latent [G H, B, T, n, R] and d q_rope [B, T, G H, Dr] in float32). delta: scale * D;
    lse2 the log2-domain logsumexp (mlra_attention_gpu_backward's prescaled inputs). stages: the query tiles'
    pipeline slots (None: as many as fit). head_splits P: each block's query heads split over P CTAs per key tile,
    each writing its part of the key side's gradients; the key tiles vary fastest in the grid, so that the CTAs
    running at once reduce into few heads' dQ accumulators."""
    heads, b, t, n, r = ql.shape
    if head_splits < 1 or (heads // groups) % head_splits:
        raise ValueError(f"head_splits={head_splits} must divide each block's {heads // groups} query heads")
    h = heads // groups // head_splits  # the query heads of each CTA
    dr, dtype = kr.shape[-1], lat.dtype
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    chunks = lat_chunks + rope_chunks  # dQ's column chunks: chunk c is warpgroup c % COMPUTE_WGS's
    kv_tiles = t // (COMPUTE_WGS * TILE)
    size = 2  # the GPU takes 16-bit inputs only; interpret mode's float32 runs the same pipeline
    resident = COMPUTE_WGS * TILE * ((r + dr) * size + 2 * TILE * size) + chunks * TILE * CHUNK * 4
    stages = stages_that_fit(resident, TILE * ((2 * r + dr) * size + 8), stages)
    scale_log2, transforms = scale * LOG2E, smem_transforms(dtype)
    # float32 rows of 128 bytes, swizzled: the WGMMA layout's stores would otherwise meet 8 to a bank
    staging = () if interpret else (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    shape = (TILE, TILE)

    def kernel(ql_ref, qr_ref, lat_ref, kr_ref, do_ref, lse_ref, delta_ref, _dql, _dqr, *rest):
        dlat_ref, dkr_ref, dql_ref, dqr_ref, scoped = rest
        (klat_smem, kkr_smem, ql_smem, qr_smem, do_smem, lse_smem, delta_smem, dst_smem, dq_smem), barriers = scoped
        k_barriers, q_barriers, consumed, ds_ready, done = barriers
        part, bi, wg = lax.axis_index("part"), lax.axis_index("batch"), lax.axis_index("wg")
        j, split = part // head_splits, lax.rem(part, head_splits)
        # block c G + g: branch c of heads g H ..; this CTA's split of them
        branch, first_head = j // groups, (lax.rem(j, groups) * head_splits + split) * h
        kv_tile = lax.axis_index("kv_tile")
        first = kv_tile * COMPUTE_WGS  # the first query tile at or after the CTA's first key
        per_head = t // TILE - first
        total = h * per_head

        def key_chunk(w, c):  # chunk c of warpgroup w's [latent || k_rope] tile
            return klat_smem.at[w, c] if c < lat_chunks else kkr_smem.at[w, c - lat_chunks]

        def accumulator(c, hi, rows):  # chunk c of dQ's accumulator at head hi's rows
            if c < lat_chunks:
                return dql_ref.at[hi, bi, rows, branch, pl.ds(c * CHUNK, CHUNK)]
            return dqr_ref.at[bi, rows, hi, pl.ds((c - lat_chunks) * CHUNK, CHUNK)]

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            k0 = kv_tile * (COMPUTE_WGS * TILE) + wg * TILE
            keys = pl.ds(k0, TILE)
            for c in range(lat_chunks):
                plgpu.copy_gmem_to_smem(
                    lat_ref.at[bi, keys, j, pl.ds(c * CHUNK, CHUNK)], klat_smem.at[wg, c], k_barriers.at[wg]
                )
            for c in range(rope_chunks):
                plgpu.copy_gmem_to_smem(
                    kr_ref.at[bi, keys, pl.ds(c * CHUNK, CHUNK)], kkr_smem.at[wg, c], k_barriers.at[wg]
                )
            plgpu.barrier_wait(k_barriers.at[wg])

            def scores(slot):  # S^T = [latent || k_rope] [q_latent || q_rope]^T, dP^T = latent dO^T
                return (
                    [(0, klat_smem.at[wg, c], ql_smem.at[slot, c], True) for c in range(lat_chunks)]
                    + [(0, kkr_smem.at[wg, c], qr_smem.at[slot, c], True) for c in range(rope_chunks)]
                    + [(1, klat_smem.at[wg, c], do_smem.at[slot, c], True) for c in range(lat_chunks)]
                )

            def grads(slot, p16, ds16):  # P^T dO and dS^T q_latent onto d latent, dS^T q_rope onto d k_rope
                return (
                    [(c, p16, do_smem.at[slot, c], False) for c in range(lat_chunks)]
                    + [(c, ds16, ql_smem.at[slot, c], False) for c in range(lat_chunks)]
                    + [(lat_chunks + c, ds16, qr_smem.at[slot, c], False) for c in range(rope_chunks)]
                )

            def probabilities(s_t, dp_t, local, slot, masked):
                """P^T and dS^T = scale P^T (dP^T - D) of one query tile, in the inputs' dtype."""
                if masked:  # query q0 + column sees key k0 + row when q >= k
                    q0 = (first + local) * TILE
                    keep = iota(shape, 1, interpret) + q0 >= iota(shape, 0, interpret) + k0
                    s_t = jnp.where(keep, s_t, -jnp.inf)
                lse = vector(lse_smem.at[slot], 0, interpret)
                p_t = jnp.exp2(s_t * scale_log2 - lax.broadcast_in_dim(lse, shape, [1]))
                d = lax.broadcast_in_dim(vector(delta_smem.at[slot], 0, interpret), shape, [1])
                return p_t.astype(dtype), (p_t * (dp_t * scale - d)).astype(dtype)

            def query_grads(w, buf, hi, rows):
                """Warpgroup w's chunks of the tile's dQ = sum over both key tiles of dS [latent || k_rope], one
                chunk at a time (one accumulator of 64 columns beside the key side's), added into the
                accumulators."""
                for issued, c in enumerate(range(w, chunks, COMPUTE_WGS)):
                    terms = lambda c=c: [  # noqa: E731
                        (0, TransposedA(dst_smem.at[buf, v]), key_chunk(v, c), False) for v in range(COMPUTE_WGS)
                    ]
                    # the chunk's previous reduction has read the staging (this tile's later ones may still run)
                    plgpu.wait_smem_to_gmem(issued, wait_read_only=True)
                    (part,) = mma((zeros_tile((TILE, CHUNK), interpret),), terms, interpret)
                    dq_smem.at[c][...] = part
                    plgpu.commit_smem()
                    _reduce_add(dq_smem.at[c], accumulator(c, hi, rows), interpret)

            def release(i):  # the slot is refilled only while tiles remain to load: every phase is awaited
                pl.when(i + stages < total)(lambda: plgpu.barrier_arrive(consumed.at[lax.rem(i, jnp.int32(stages))]))

            def step(i, local, carry, masked):
                slot, buf = lax.rem(i, jnp.int32(stages)), lax.rem(i, 2)
                plgpu.barrier_wait(q_barriers.at[slot])
                s_t, dp_t = mma((zeros_tile(shape, interpret),) * 2, lambda: scores(slot), interpret)
                p16, ds16 = probabilities(s_t, dp_t, local, slot, masked)
                dst_smem.at[buf, wg][...] = ds16
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[buf])
                carry = mma(carry, lambda: grads(slot, Reg(p16), Reg(ds16)), interpret)
                release(i)
                plgpu.barrier_wait(ds_ready.at[buf])  # both warpgroups' dS^T are stored
                hi, rows = first_head + i // per_head, pl.ds((first + local) * TILE, TILE)
                for w in range(COMPUTE_WGS):
                    pl.when(wg == w)(functools.partial(query_grads, w, buf, hi, rows))
                return carry

            def head(hi, carry):  # the first two tiles masked (the second warpgroup's first wholly), then the rest
                base = hi * per_head
                masked, unmasked = (functools.partial(step, masked=m) for m in (True, False))
                carry = lax.fori_loop(0, COMPUTE_WGS, lambda m, c: masked(base + m, m, c), carry)
                return lax.fori_loop(COMPUTE_WGS, per_head, lambda m, c: unmasked(base + m, m, c), carry)

            accs = lax.fori_loop(0, h, head, (zeros_tile((TILE, CHUNK), interpret),) * chunks)
            plgpu.barrier_arrive(done)  # both warpgroups' last dQ products have read the key tiles
            plgpu.barrier_wait(done)
            for c in range(lat_chunks):
                klat_smem.at[wg, c][...] = accs[c].astype(dtype)
            for c in range(rope_chunks):
                kkr_smem.at[wg, c][...] = accs[lat_chunks + c].astype(dtype)
            plgpu.commit_smem()
            for c in range(lat_chunks):
                plgpu.copy_smem_to_gmem(klat_smem.at[wg, c], dlat_ref.at[split, bi, keys, j, pl.ds(c * CHUNK, CHUNK)])
            for c in range(rope_chunks):
                plgpu.copy_smem_to_gmem(kkr_smem.at[wg, c], dkr_ref.at[split, bi, j, keys, pl.ds(c * CHUNK, CHUNK)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(i, slot):
                hi, rows = first_head + i // per_head, pl.ds((first + lax.rem(i, per_head)) * TILE, TILE)
                for c in range(lat_chunks):
                    columns = pl.ds(c * CHUNK, CHUNK)
                    plgpu.copy_gmem_to_smem(
                        ql_ref.at[hi, bi, rows, branch, columns], ql_smem.at[slot, c], q_barriers.at[slot]
                    )
                    plgpu.copy_gmem_to_smem(
                        do_ref.at[hi, bi, rows, branch, columns], do_smem.at[slot, c], q_barriers.at[slot]
                    )
                for c in range(rope_chunks):
                    plgpu.copy_gmem_to_smem(
                        qr_ref.at[bi, rows, hi, pl.ds(c * CHUNK, CHUNK)], qr_smem.at[slot, c], q_barriers.at[slot]
                    )
                plgpu.copy_gmem_to_smem(lse_ref.at[bi, branch, hi, rows], lse_smem.at[slot], q_barriers.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[bi, branch, hi, rows], delta_smem.at[slot], q_barriers.at[slot])

            stream_tiles(fetch, consumed, stages, stages, total)

    def entry(*refs):
        smem = (
            plgpu.SMEM((COMPUTE_WGS, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, rope_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, rope_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, TILE), jnp.float32),
            plgpu.SMEM((stages, TILE), jnp.float32),
            plgpu.SMEM((2, COMPUTE_WGS, TILE, TILE), dtype, transforms=transforms),  # dS^T, two buffers in turn
            plgpu.SMEM((chunks, TILE, CHUNK), jnp.float32, transforms=staging),  # dQ's chunks, for their reductions
        )
        barriers = (
            plgpu.Barrier(num_arrivals=lat_chunks + rope_chunks, num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=2 * lat_chunks + rope_chunks + 2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    mesh = plgpu.Mesh(
        grid=(kv_tiles, n * groups * head_splits, b),
        grid_names=("kv_tile", "part", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
    )
    out_types = (
        jax.ShapeDtypeStruct((head_splits, *lat.shape), dtype),
        jax.ShapeDtypeStruct((head_splits, b, n * groups, t, dr), dtype),
        jax.ShapeDtypeStruct(ql.shape, jnp.float32),
        jax.ShapeDtypeStruct((b, t, heads, dr), jnp.float32),
    )
    zeros = (jnp.zeros(ql.shape, jnp.float32), jnp.zeros((b, t, heads, dr), jnp.float32))
    call = mpmd._mpmd_map(
        [(mesh, entry)],
        out_types,
        input_output_aliases={7: 2, 8: 3},  # the zeroed dQ accumulators
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        name="mlra_attention_dkv_dq",
    )
    return call(ql, qr, lat, kr, do, lse2, delta, *zeros)
