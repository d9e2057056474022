"""Latent decode attention as a Pallas Mosaic GPU kernel for Hopper (H100/H200).

Same contract as latent_decode_reference.reference. Each CTA takes one (sequence, latent block,
64-head group, KV split; in "halves" mode, value half). A memory warpgroup streams the query once and then the RoPE
key and latent tiles of its KV range by TMA through `stages` shared-memory slots; two
compute warpgroups run, per tile, QK^T as wgmma over [q_rope || q_latent] x
[k_rope || latent]^T, an online softmax in the log2 domain, and PV as wgmma of P
against the same latent tile (the value is the latent: it is read once).

  * latent <= 256 ("tiles"): the warpgroups take alternate tiles, each with its own
    softmax state, so one's softmax overlaps the other's tensor-core work.
  * latent 512 ("columns", MLA): both take every tile and split the value columns, as
    FlashMLA does, so that each accumulator fits in registers.
  * latent 512 where those CTAs would fill at most half the SMs ("halves", MLA at batch 1 and up to
    8K tokens): two CTAs per KV split take half the value columns each, and their warpgroups
    alternate tiles as in "tiles". There the kernel is bound by the tensor cores (24 heads fill 24
    of wgmma's 64 rows, and in "columns" both warpgroups compute each tile's scores): on an H100 a
    64-key tile takes 1.36 us of one SM instead of 2.14, and the 2.9B MLA's 8K-token call 7.3 us
    instead of 9.3 (`python -m mlra_jax.benchmarks.latent_kernel bound`).

Each CTA writes one split-KV partial (normalized output and log2-sum-exp; in "tiles" mode
warpgroup 1 hands its softmax state to warpgroup 0 through SMEM, which merges the two);
`combine_gpu`, a second small kernel, merges the splits.
Every SMEM tile is 64 columns wide (the 128-byte swizzle of bf16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from mlra_jax.pallas_kernels.gpu_interpret import interpret_params
from mlra_jax.pallas_kernels.latent_decode_common import LOG2E, check_page_table, choose_splits, combine

CHUNK = 64  # columns per SMEM tile and per wgmma N
HEADS = 64  # query rows per CTA (the wgmma M of one warpgroup)
SMEM_BYTES = 220 * 1024
DEFAULT_SMS = 132  # an H100 SXM: the plan where the device reports no SM count (interpret mode on a CPU)
COMBINE_COLUMNS = 128  # values per CTA of the split-KV combine: one per thread of a warpgroup


COMPUTE_WGS = 2


def _plan(dr: int, r: int, itemsize: int, block_kv: int | None = None) -> tuple[bool, int, int]:
    """(split value columns?, KV tile rows, pipeline stages). The "tiles" mode takes the largest tile
    that keeps at least 4 stages, and up to 8 (an even count: slot s always feeds warpgroup s % 2);
    MLA's 512-wide latent leaves room for two 64-row stages."""
    by_columns = r > 256
    chunks = (dr + r) // CHUNK
    q_bytes = chunks * HEADS * CHUNK * itemsize

    def stages_for(block_kv: int) -> int:
        return (SMEM_BYTES - q_bytes - COMPUTE_WGS * HEADS * 4) // (chunks * block_kv * CHUNK * itemsize)

    if by_columns and stages_for(64) >= 2:
        return True, 64, 2
    for rows in (block_kv,) if block_kv else (128, 64):
        if not by_columns and (stages := stages_for(rows)) >= 4:
            return False, rows, min(stages - stages % 2, 8)
    raise ValueError(f"latent width {r} with RoPE {dr} does not fit the pipeline in shared memory")


def sm_count(device: jax.Device | None = None) -> int:
    """The GPU's streaming multiprocessors (the device's `core_count`: 132 on an H100 SXM, 114 on an H100 PCIe),
    DEFAULT_SMS where the device reports none."""
    device = device if device is not None else jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_SMS


def launch_plan(
    programs: int, slots: int, block_kv: int, by_columns: bool, paged: bool, sms: int, splits: int | None = None
) -> tuple[int, int]:
    """(KV splits, halves) for `programs` (batch x blocks x head groups) over `sms` SMs: enough splits to fill
    the GPU (or `splits` as given). "halves": where the "columns" CTAs fill at most half the GPU (MLA at batch 1
    and a short context), two CTAs per KV split take half the value columns each, their warpgroups alternating
    tiles as in "tiles" mode: every tile's scores are computed once per CTA, not once per warpgroup, on twice
    the SMs."""
    splits = splits or choose_splits(programs, slots, block_kv * COMPUTE_WGS, sms)
    halves = 2 if by_columns and not paged and 2 * splits * programs <= sms else 1
    return splits, halves


@functools.partial(jax.jit, static_argnames=("scale", "splits", "block_kv"))
def latent_decode_gpu(
    q_rope: jax.Array,
    q_latent: jax.Array,
    k_rope: jax.Array,
    latent: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    *,
    scale: float,
    splits: int | None = None,
    block_kv: int | None = None,
    page_table: jax.Array | None = None,
) -> jax.Array:
    """q_rope [B, N, H, Dr], q_latent [B, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R] -> [B, N, H, R];
    or a paged cache k_rope [P, page, Dr], latent [P, page, N, R] with page_table [B, S / page]."""
    out, lse = latent_partials_gpu(
        q_rope,
        q_latent,
        k_rope,
        latent,
        starts,
        ends,
        scale=scale,
        splits=splits,
        block_kv=block_kv,
        page_table=page_table,
    )
    heads = q_rope.shape[2]
    if out.shape[2] == 1 or out.shape[-1] % COMBINE_COLUMNS:  # one split: a slice; odd widths: XLA's combine
        return combine(out, lse, latent.dtype)[:, :, :heads]
    return combine_gpu(out, lse, latent.dtype, heads)


def combine_gpu(
    partial_out: jax.Array, partial_lse: jax.Array, dtype: jnp.dtype, heads: int, *, interpret: bool = False
) -> jax.Array:
    """latent_decode_common.combine as one Mosaic GPU kernel (the same result; XLA takes four kernels, launch-bound
    at batch 1): partials out [B, N, P, H', R] and lse [B, N, P, H'] -> [B, N, heads, R]. A CTA merges one
    head's row of COMBINE_COLUMNS values over the P splits: the weights are scalars, the rows 128-wide
    vectors (one value per thread). interpret=True runs it in GPU interpret mode (on CPU, for the tests)."""
    b, n, p, _, r = partial_out.shape

    def kernel(out_ref, lse_ref, merged_ref):
        column, head, bn = lax.axis_index("column"), lax.axis_index("head"), lax.axis_index("bn")
        bi, ni, cols = bn // n, lax.rem(bn, n), pl.ds(column * COMBINE_COLUMNS, COMBINE_COLUMNS)
        rows = [out_ref[bi, ni, split, head, cols] for split in range(p)]  # every load issued up front
        lses = [lse_ref[bi, ni, split, head] for split in range(p)]
        top = functools.reduce(jnp.maximum, lses)
        top = jnp.where(top == -jnp.inf, 0.0, top)  # every split empty: zero weights, a zero output
        acc, total = jnp.zeros((COMBINE_COLUMNS,), jnp.float32), jnp.float32(0)
        for row, lse in zip(rows, lses):
            weight = jnp.exp2(lse - top)
            acc = acc + row.astype(jnp.float32) * weight
            total = total + weight
        merged_ref[bi, ni, head, cols] = (acc * (1.0 / jnp.maximum(total, 1e-30))).astype(dtype)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b, n, heads, r), dtype),
        grid=(r // COMBINE_COLUMNS, heads, b * n),
        grid_names=("column", "head", "bn"),
        interpret=interpret_params(interpret),
    )(partial_out, partial_lse)


@functools.partial(jax.jit, static_argnames=("scale", "splits", "block_kv"))
def latent_partials_gpu(
    q_rope: jax.Array,
    q_latent: jax.Array,
    k_rope: jax.Array,
    latent: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    *,
    scale: float,
    splits: int | None = None,
    block_kv: int | None = None,
    page_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The kernel alone: split-KV partials out [B, N, P, H', R] (normalized) and log2-sum-exp [B, N, P, H']
    (H' = H, or H padded to whole 64-row groups), merged by latent_decode_common.combine."""
    b, n, h, dr = q_rope.shape
    r = latent.shape[3]
    dtype = latent.dtype
    if dtype not in (jnp.bfloat16, jnp.float16) or dr % CHUNK or r % CHUNK:
        raise ValueError(
            f"the Mosaic GPU latent kernel takes bf16/f16 with RoPE and latent widths that are multiples "
            f"of {CHUNK}; got {dtype}, {dr}, {r}"
        )
    paged = page_table is not None
    if paged:
        page = check_page_table(k_rope, latent, page_table, b)
        s = page_table.shape[1] * page
        if page % 64:
            raise ValueError(
                f"the Mosaic GPU kernel takes pages of a multiple of 64 slots (whole KV tiles); got {page}"
            )
    else:
        s, page = latent.shape[1], 0
        page_table = jnp.zeros((1, 1), jnp.int32)  # unused
        if s % 8:
            raise ValueError(
                f"the cache holds {s} slots; TMA tiles rows in 8s, so allocate a multiple of 8 "
                f"(the library's decode caches are)"
            )
    groups = pl.cdiv(h, HEADS)
    # Query rows a CTA loads and stores. Fewer than 64 heads (GLA-2's 32) fill the first rows of the
    # 64-row tile (the rest are never stored); other head counts are padded to whole 64-row groups.
    rows = h if h < HEADS and h % 8 == 0 else HEADS
    if groups * rows != h:
        pad = ((0, 0), (0, 0), (0, groups * HEADS - h), (0, 0))
        q_rope, q_latent = jnp.pad(q_rope, pad), jnp.pad(q_latent, pad)
    by_columns, block_kv, stages = _plan(dr, r, jnp.dtype(dtype).itemsize, block_kv)
    # A paged KV tile is made of whole pages (page <= tile) or lies inside one page (page > tile).
    if page and max(page, block_kv) % min(page, block_kv):
        raise ValueError(
            f"pages of {page} slots do not tile into the kernel's KV tiles of {block_kv}; pass "
            f"block_kv=64 or use pages of a multiple of {block_kv}"
        )
    tile_pages, page_rows = (block_kv // page, page) if 0 < page <= block_kv else (1, block_kv)
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    splits, halves = launch_plan(b * n * groups, s, block_kv, by_columns, paged, sm_count(), splits)
    by_columns = by_columns and halves == 1
    wg_chunks = lat_chunks // COMPUTE_WGS if by_columns else lat_chunks // halves  # value chunks per warpgroup
    tile_transforms = (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128))

    def kernel(starts_ref, ends_ref, pages_ref, qr_ref, ql_ref, kr_ref, lat_ref, o_ref, lse_ref, scoped):
        (qr_smem, ql_smem, kr_smem, lat_smem, lse_smem), (q_barrier, kv_barriers, consumed, done, stored) = scoped
        split, block_head, bi = lax.axis_index("split"), lax.axis_index("block_head"), lax.axis_index("batch")
        half, block_head = lax.rem(block_head, halves), block_head // halves
        ni, heads = block_head // groups, pl.ds((block_head % groups) * rows, rows)
        loaded = pl.ds(0, rows)  # the SMEM rows that hold (and return) this CTA's heads
        wg = lax.axis_index("wg")
        start, end = starts_ref[bi], ends_ref[bi]
        first, last = start // block_kv, (end + block_kv - 1) // block_kv
        per_split = (last - first + splits - 1) // splits
        t0 = first + split * per_split
        steps = jnp.maximum(jnp.minimum(t0 + per_split, last) - t0, 0)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")  # FA3's split: two compute, one memory warpgroup
            plgpu.barrier_wait(q_barrier.at[0])
            m_i = plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((HEADS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            accs = tuple(
                plgpu.layout_cast(jnp.full((HEADS, CHUNK), 0, jnp.float32), plgpu.Layout.WGMMA)
                for _ in range(wg_chunks)
            )

            def kv_step(i, carry):
                accs, m_i, l_i = carry
                step = i if by_columns else i * COMPUTE_WGS + wg  # "tiles": warpgroup w takes w, w + 2, ...
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

                first_chunk = wg * wg_chunks if by_columns else half * wg_chunks

                def values(acc_refs):
                    for j, acc_ref in enumerate(acc_refs):
                        plgpu.wgmma(acc_ref, p16, lat_smem.at[slot, first_chunk + j])

                accs = pl.run_state(values)(tuple(plgpu.ACC.init(a) for a in accs))
                plgpu.barrier_arrive(consumed.at[slot])
                return accs, m_new, l_i

            my_steps = steps if by_columns else (steps - wg + COMPUTE_WGS - 1) // COMPUTE_WGS
            accs, m_i, l_i = lax.fori_loop(0, my_steps, kv_step, (accs, m_i, l_i))
            # Both warpgroups are done reading the query before outputs overwrite its SMEM.
            plgpu.barrier_arrive(done.at[0])
            plgpu.barrier_wait(done.at[0])
            l_safe = jnp.maximum(l_i, 1e-30)  # an empty range has l = 0, a zero output and lse = -inf
            lse = m_i + jnp.log2(l_safe)
            outs = [acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0]) for acc in accs]

            def write_out(outs, lse, first_chunk, store_lse, first_column=None):
                """outs through ql_smem's chunks first_chunk.. to the value chunks first_column.. (the same by
                default) of the output; the lse too where store_lse (the first half's CTA stores it)."""
                first_column = first_chunk if first_column is None else first_column
                for j, o in enumerate(outs):
                    ql_smem.at[first_chunk + j][...] = o.astype(dtype)
                if store_lse:
                    lse_smem.at[wg][...] = lse
                plgpu.commit_smem()
                for j in range(len(outs)):
                    plgpu.copy_smem_to_gmem(
                        ql_smem.at[first_chunk + j, loaded],
                        o_ref.at[bi, ni, split, heads, pl.ds((first_column + j) * CHUNK, CHUNK)],
                    )
                if store_lse:
                    pl.when(half == 0)(
                        lambda: plgpu.copy_smem_to_gmem(lse_smem.at[wg, loaded], lse_ref.at[bi, ni, split, heads])
                    )
                plgpu.wait_smem_to_gmem(0)

            if by_columns:  # disjoint value columns: both write at once, warpgroup 0 the shared lse
                pl.when(wg == 0)(lambda: write_out(outs, lse, 0, store_lse=True))
                pl.when(wg == 1)(lambda: write_out(outs, lse, wg_chunks, store_lse=False))
            else:  # two softmax states over disjoint tiles: warpgroup 1 hands its one to 0 through SMEM

                @pl.when(wg == 1)
                def _hand_over():
                    for j, o in enumerate(outs):
                        ql_smem.at[j][...] = o.astype(dtype)
                    lse_smem.at[1][...] = lse
                    plgpu.barrier_arrive(stored.at[0])

                @pl.when(wg == 0)
                def _merge():
                    plgpu.barrier_wait(stored.at[0])
                    other_lse = plgpu.load(lse_smem.at[1], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                    top = jnp.maximum(lse, other_lse)
                    top = jnp.where(top == -jnp.inf, 0.0, top)
                    mine, other = jnp.exp2(lse - top), jnp.exp2(other_lse - top)
                    total = mine + other  # 0 where both ranges were empty
                    inverse = 1.0 / jnp.maximum(total, 1e-30)
                    mine, other = mine * inverse, other * inverse
                    merged = [
                        o * lax.broadcast_in_dim(mine, o.shape, [0])
                        + plgpu.load(ql_smem.at[j], (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                        * lax.broadcast_in_dim(other, o.shape, [0])
                        for j, o in enumerate(outs)
                    ]
                    write_out(merged, top + jnp.log2(total), 0, store_lse=True, first_column=half * wg_chunks)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for c in range(rope_chunks):
                plgpu.copy_gmem_to_smem(
                    qr_ref.at[bi, ni, heads, pl.ds(c * CHUNK, CHUNK)], qr_smem.at[c, loaded], q_barrier.at[0]
                )
            for c in range(lat_chunks):
                plgpu.copy_gmem_to_smem(
                    ql_ref.at[bi, ni, heads, pl.ds(c * CHUNK, CHUNK)], ql_smem.at[c, loaded], q_barrier.at[0]
                )

            def locate(step):
                """(cache row, first slot in it) of each piece of the step-th tile."""
                pieces = []
                for j in range(tile_pages):
                    first_slot = (t0 + step) * block_kv + j * page_rows
                    if paged:  # pages past the table only back masked slots: clamp
                        index = jnp.minimum(first_slot // page, page_table.shape[1] - 1)
                        within = lax.rem(first_slot, jnp.int32(page)) if page > block_kv else 0
                        pieces.append((pages_ref[bi, index], within))
                    else:
                        pieces.append((bi, first_slot))
                return pieces

            def fetch(pieces, slot):
                for j, (row, first) in enumerate(pieces):
                    rows, into = pl.ds(first, page_rows), pl.ds(j * page_rows, page_rows)
                    for c in range(rope_chunks):
                        plgpu.copy_gmem_to_smem(
                            kr_ref.at[row, rows, pl.ds(c * CHUNK, CHUNK)],
                            kr_smem.at[slot, c, into],
                            kv_barriers.at[slot],
                        )
                    for c in range(lat_chunks):
                        plgpu.copy_gmem_to_smem(
                            lat_ref.at[row, rows, ni, pl.ds(c * CHUNK, CHUNK)],
                            lat_smem.at[slot, c, into],
                            kv_barriers.at[slot],
                        )

            first_tiles = [locate(i) for i in range(stages)]  # every page-table read before the first copy
            for i in range(stages):
                pl.when(i < steps)(functools.partial(fetch, first_tiles[i], i))

            @pl.loop(0, jnp.maximum(steps - stages, 0))
            def _refill(step):
                slot = lax.rem(step, jnp.int32(stages))
                pieces = locate(step + stages)  # the page table is read while the slot is still in use
                plgpu.barrier_wait(consumed.at[slot])
                fetch(pieces, slot)

    def entry(*refs):
        smem = (
            plgpu.SMEM((rope_chunks, HEADS, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((lat_chunks, HEADS, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((stages, rope_chunks, block_kv, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((stages, lat_chunks, block_kv, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((COMPUTE_WGS, HEADS), jnp.float32),
        )
        copies = rope_chunks + lat_chunks
        barriers = (
            plgpu.Barrier(num_arrivals=copies, num_barriers=1),
            plgpu.Barrier(num_arrivals=copies * tile_pages, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS if by_columns else 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    out, lse = plgpu.kernel(
        entry,
        out_type=[
            jax.ShapeDtypeStruct((b, n, splits, groups * rows, r), dtype),
            jax.ShapeDtypeStruct((b, n, splits, groups * rows), jnp.float32),
        ],
        grid=(splits, n * groups * halves, b),
        grid_names=("split", "block_head", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), page_table.astype(jnp.int32), q_rope, q_latent, k_rope, latent)
    return out, lse
