"""Latent decode attention as a Pallas Mosaic GPU kernel for Hopper (H100/H200).

Same contract as latent_decode.reference. Each CTA takes one (sequence, latent block,
64-head group, KV split). A memory warpgroup streams the query once and then the RoPE
key and latent tiles of its KV range by TMA through `stages` shared-memory slots; one
or two compute warpgroups run, per tile, QK^T as wgmma over [q_rope || q_latent] x
[k_rope || latent]^T, an online softmax in the log2 domain, and PV as wgmma of P
against the same latent tile (the value is the latent: it is read once). MLA's
512-wide latent is split by value columns over two compute warpgroups (each also
computes the scores, as FlashMLA does), keeping each accumulator in registers. The
split-KV partials (normalized output and log2-sum-exp) are merged by
latent_decode.combine. Every tile is 64 columns wide (the 128-byte swizzle of bf16).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.latent_decode import LOG2E, choose_splits, combine

CHUNK = 64  # columns per SMEM tile and per wgmma N
HEADS = 64  # query rows per CTA (the wgmma M of one warpgroup)
SMEM_BYTES = 220 * 1024
NUM_SMS = 132


def _plan(dr: int, r: int, block_kv: int, itemsize: int) -> tuple[int, int, int]:
    """(compute warpgroups, chunks per warpgroup, pipeline stages)."""
    wg_cols = min(r, 256)
    chunks = (dr + r) // CHUNK
    q_bytes = chunks * HEADS * CHUNK * itemsize
    stage_bytes = chunks * block_kv * CHUNK * itemsize
    stages = min(6, (SMEM_BYTES - q_bytes - 4 * HEADS * 4) // stage_bytes)
    if stages < 2:
        raise ValueError(f"latent width {r} with RoPE {dr} does not fit two pipeline stages in shared memory")
    return r // wg_cols, wg_cols // CHUNK, stages


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "splits"))
def latent_decode_gpu(q_rope: jax.Array, q_latent: jax.Array, k_rope: jax.Array, latent: jax.Array,
                      starts: jax.Array, ends: jax.Array, *, scale: float, block_kv: int = 64,
                      splits: int | None = None) -> jax.Array:
    """q_rope [B, N, H, Dr], q_latent [B, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R] -> [B, N, H, R]."""
    b, n, h, dr = q_rope.shape
    s, r = latent.shape[1], latent.shape[3]
    dtype = latent.dtype
    if dtype not in (jnp.bfloat16, jnp.float16) or dr % CHUNK or r % CHUNK:
        raise ValueError(f"the Mosaic GPU latent kernel takes bf16/f16 with RoPE and latent widths that are multiples "
                         f"of {CHUNK}; got {dtype}, {dr}, {r}")
    if s % 8:
        raise ValueError(f"the cache holds {s} slots; TMA tiles rows in 8s, so allocate a multiple of 8 "
                         f"(decode.cache.init_cache does)")
    groups = pl.cdiv(h, HEADS)
    if groups * HEADS != h:  # pad the heads to whole warpgroup tiles
        pad = ((0, 0), (0, 0), (0, groups * HEADS - h), (0, 0))
        q_rope, q_latent = jnp.pad(q_rope, pad), jnp.pad(q_latent, pad)
    compute_wgs, wg_chunks, stages = _plan(dr, r, block_kv, jnp.dtype(dtype).itemsize)
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    splits = splits or choose_splits(b * n * groups, s, block_kv, NUM_SMS)
    tile_transforms = (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128))

    def kernel(starts_ref, ends_ref, qr_ref, ql_ref, kr_ref, lat_ref, o_ref, lse_ref, scoped):
        (qr_smem, ql_smem, kr_smem, lat_smem, lse_smem), (q_barrier, kv_barriers, consumed, done) = scoped
        split, block_head, bi = lax.axis_index("split"), lax.axis_index("block_head"), lax.axis_index("batch")
        ni, heads = block_head // groups, pl.ds((block_head % groups) * HEADS, HEADS)
        wg = lax.axis_index("wg")
        start, end = starts_ref[bi], ends_ref[bi]
        first, last = start // block_kv, (end + block_kv - 1) // block_kv
        per_split = (last - first + splits - 1) // splits
        t0 = first + split * per_split
        steps = jnp.maximum(jnp.minimum(t0 + per_split, last) - t0, 0)

        @pl.when(wg < compute_wgs)
        def _compute():
            if compute_wgs == 2:  # FA3's register split for two compute warpgroups and one memory warpgroup
                plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_barrier.at[0])
            m_i = plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((HEADS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            accs = tuple(plgpu.layout_cast(jnp.full((HEADS, CHUNK), 0, jnp.float32), plgpu.Layout.WGMMA)
                         for _ in range(wg_chunks))

            def kv_step(step, carry):
                accs, m_i, l_i = carry
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(kv_barriers.at[slot])

                def scores(acc_ref):
                    for c in range(rope_chunks):
                        plgpu.wgmma(acc_ref, qr_smem.at[c], plgpu.transpose_ref(kr_smem.at[slot, c], (1, 0)))
                    for c in range(lat_chunks):
                        plgpu.wgmma(acc_ref, ql_smem.at[c], plgpu.transpose_ref(lat_smem.at[slot, c], (1, 0)))
                    return acc_ref[...]

                qk = pl.run_scoped(scores, plgpu.ACC((HEADS, block_kv), jnp.float32))
                slots = plgpu.broadcasted_iota(jnp.int32, (HEADS, block_kv), 1, layout=plgpu.Layout.WGMMA)
                slots = slots + (t0 + step) * block_kv
                qk = jnp.where((slots >= start) & (slots < end), qk * (scale * LOG2E), -jnp.inf)
                m_new = jnp.maximum(m_i, qk.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(qk - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                accs = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs)
                p16 = p.astype(dtype)

                def values(acc_refs):
                    for i, acc_ref in enumerate(acc_refs):
                        plgpu.wgmma(acc_ref, p16, lat_smem.at[slot, wg * wg_chunks + i])

                accs = pl.run_state(values)(tuple(plgpu.ACC.init(a) for a in accs))
                plgpu.barrier_arrive(consumed.at[slot])
                return accs, m_new, l_i

            accs, m_i, l_i = lax.fori_loop(0, steps, kv_step, (accs, m_i, l_i))
            # Every compute warpgroup is done reading the query before the outputs overwrite it.
            plgpu.barrier_arrive(done.at[0])
            plgpu.barrier_wait(done.at[0])
            inverse = 1.0 / jnp.maximum(l_i, 1e-30)  # an empty split has l = 0 and a zero output
            for i, acc in enumerate(accs):
                chunk = wg * wg_chunks + i
                ql_smem.at[chunk][...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(dtype)

            @pl.when(wg == 0)
            def _lse():
                lse_smem[...] = m_i + jnp.log2(jnp.maximum(l_i, 1e-30))

            plgpu.commit_smem()
            for i in range(wg_chunks):
                chunk = wg * wg_chunks + i
                plgpu.copy_smem_to_gmem(ql_smem.at[chunk],
                                        o_ref.at[bi, ni, split, heads, pl.ds(chunk * CHUNK, CHUNK)])

            @pl.when(wg == 0)
            def _store_lse():
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, ni, split, heads])

            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == compute_wgs)
        def _memory():
            if compute_wgs == 2:
                plgpu.set_max_registers(40, action="decrease")
            for c in range(rope_chunks):
                plgpu.copy_gmem_to_smem(qr_ref.at[bi, ni, heads, pl.ds(c * CHUNK, CHUNK)], qr_smem.at[c],
                                        q_barrier.at[0])
            for c in range(lat_chunks):
                plgpu.copy_gmem_to_smem(ql_ref.at[bi, ni, heads, pl.ds(c * CHUNK, CHUNK)], ql_smem.at[c],
                                        q_barrier.at[0])

            def fetch(step, slot):
                rows = pl.ds((t0 + step) * block_kv, block_kv)
                for c in range(rope_chunks):
                    plgpu.copy_gmem_to_smem(kr_ref.at[bi, rows, pl.ds(c * CHUNK, CHUNK)], kr_smem.at[slot, c],
                                            kv_barriers.at[slot])
                for c in range(lat_chunks):
                    plgpu.copy_gmem_to_smem(lat_ref.at[bi, rows, ni, pl.ds(c * CHUNK, CHUNK)], lat_smem.at[slot, c],
                                            kv_barriers.at[slot])

            for i in range(stages):
                pl.when(i < steps)(functools.partial(fetch, i, i))

            @pl.loop(0, jnp.maximum(steps - stages, 0))
            def _refill(step):
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(consumed.at[slot])
                fetch(step + stages, slot)

    def entry(*refs):
        smem = (plgpu.SMEM((rope_chunks, HEADS, CHUNK), dtype, transforms=tile_transforms),
                plgpu.SMEM((lat_chunks, HEADS, CHUNK), dtype, transforms=tile_transforms),
                plgpu.SMEM((stages, rope_chunks, block_kv, CHUNK), dtype, transforms=tile_transforms),
                plgpu.SMEM((stages, lat_chunks, block_kv, CHUNK), dtype, transforms=tile_transforms),
                plgpu.SMEM((HEADS,), jnp.float32))
        copies = rope_chunks + lat_chunks
        barriers = (plgpu.Barrier(num_arrivals=copies, num_barriers=1),
                    plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=1))
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    out, lse = plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct((b, n, splits, groups * HEADS, r), dtype),
                  jax.ShapeDtypeStruct((b, n, splits, groups * HEADS), jnp.float32)],
        grid=(splits, n * groups, b),
        grid_names=("split", "block_head", "batch"),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), q_rope, q_latent, k_rope, latent)
    return combine(out, lse, dtype)[:, :, :h]


if __name__ == "__main__":  # a quick check on a GPU: python -m pallas_kernels.latent_decode_gpu
    from pallas_kernels.latent_decode import reference

    for heads, dr, r, n, s in ((64, 64, 128, 1, 5000), (32, 64, 256, 1, 3000), (64, 64, 512, 1, 4000),
                               (64, 64, 128, 2, 704)):
        keys = jax.random.split(jax.random.key(0), 4)
        bf16 = jnp.bfloat16
        args = (jax.random.normal(keys[0], (3, n, heads, dr), bf16), jax.random.normal(keys[1], (3, n, heads, r), bf16),
                jax.random.normal(keys[2], (3, s, dr), bf16), jax.random.normal(keys[3], (3, s, n, r), bf16),
                jnp.array([0, 17, s // 2]), jnp.array([s, s // 3, s // 2 + 1]))
        scale = 1 / math.sqrt(dr + r)
        got = latent_decode_gpu(*args, scale=scale).astype(jnp.float32)
        want = reference(*args, scale=scale).astype(jnp.float32)
        print(f"H={heads} Dr={dr} R={r} N={n} S={s}: max |err| {float(jnp.abs(got - want).max()):.4f}, "
              f"max |ref| {float(jnp.abs(want).max()):.3f}", flush=True)
