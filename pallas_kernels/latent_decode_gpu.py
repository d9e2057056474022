"""Latent decode attention as a Pallas Mosaic GPU kernel for Hopper (H100/H200).

Same contract as latent_decode_reference.reference. Each CTA takes one (sequence, latent block,
64-head group, KV split; in "halves" mode, value half). A memory warpgroup streams the query once and then the RoPE
key and latent tiles of its KV range by TMA through `stages` shared-memory slots; two
compute warpgroups run, per tile, QK^T as wgmma over [q_rope || q_latent] x
[k_rope || latent]^T, an online softmax in the log2 domain, and PV as wgmma of P
against the same latent tile (the value is the latent: it is read once).

  * latent <= 256 ("tiles"): the warpgroups take alternate tiles, each with its own
    softmax state, so one's softmax overlaps the other's tensor-core work.
  * latent <= 256 and heads in whole 128s ("heads": MLRA's blocks under TP, each serving all of
    DeepSeek-V3's 128 heads): a CTA serves 128 heads, each warpgroup 64 of them over every tile, so
    a KV tile crosses from L2 into SMEM once per 128 heads instead of once per 64.
  * latent 512 ("columns", MLA): both take every tile and split the value columns, as
    FlashMLA does, so that each accumulator fits in registers. Warpgroup 0 computes the tile's
    scores and softmax once and hands P and the rescale to warpgroup 1 through SMEM (P over the
    slot's RoPE key tile, which warpgroup 1 never reads).
  * latent 512 where those CTAs would fill at most half the SMs ("halves", MLA at batch 1 and up to
    8K tokens): two CTAs per KV split take half the value columns each, and their warpgroups
    alternate tiles as in "tiles". There the kernel is bound by the tensor cores (24 heads fill 24
    of wgmma's 64 rows): on an H100 a 64-key tile took 1.36 us of one SM instead of 2.14, and the
    2.9B MLA's 8K-token call 7.3 us instead of 9.3 (`python -m mlra_jax.benchmarks.latent_kernel
    bound`; measured when "columns" computed each tile's scores in both warpgroups).

Each CTA writes one split-KV partial (normalized output and log2-sum-exp; in "tiles" mode
warpgroup 1 hands its softmax state to warpgroup 0 through SMEM, which merges the two; in "heads" mode
each warpgroup writes its own heads);
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
from mlra_jax.pallas_kernels.mlra_attention_gpu import _columns, _layout, _scores, _values

CHUNK = 64  # columns per SMEM tile and per wgmma N
HEADS = 64  # query rows per CTA (the wgmma M of one warpgroup)
SMEM_BYTES = 220 * 1024
DEFAULT_SMS = 132  # an H100 SXM: the plan where the device reports no SM count (interpret mode on a CPU)
COMBINE_COLUMNS = 128  # values per CTA of the split-KV combine: one per thread of a warpgroup
COMBINE_HEADS = 8  # heads' rows per CTA of the split-KV combine (where they divide the heads)


COMPUTE_WGS = 2


def _plan(dr: int, r: int, block_kv: int | None = None, cta_heads: int = HEADS) -> tuple[bool, int, int]:
    """(split value columns?, KV tile rows, pipeline stages), sized for bf16. The "tiles" mode takes the largest
    tile that keeps at least 4 stages, and up to 8 (an even count: slot s always feeds warpgroup s % 2); "heads"
    (cta_heads = 128: both warpgroups read every tile) the largest that keeps 3; MLA's 512-wide latent leaves room
    for two 64-row stages."""
    by_columns = r > 256
    chunks = (dr + r) // CHUNK
    q_bytes = chunks * cta_heads * CHUNK * 2

    def stages_for(block_kv: int) -> int:
        small = (COMPUTE_WGS + 8) * HEADS * 4  # the lse and l, and up to 8 stages' rescales ("columns")
        return (SMEM_BYTES - q_bytes - small) // (chunks * block_kv * CHUNK * 2)

    if by_columns and stages_for(64) >= 2:
        return True, 64, 2
    for rows in (block_kv,) if block_kv else (128, 64):
        stages = stages_for(rows)
        if by_columns:
            break
        if cta_heads > HEADS and stages >= 3:
            return False, rows, min(stages, 8)
        if stages >= 4:
            return False, rows, min(stages - stages % 2, 8)
    raise ValueError(f"latent width {r} with RoPE {dr} does not fit the pipeline in shared memory")


def heads_per_cta(heads: int, r: int, programs: int = 1, sms: int = DEFAULT_SMS, requested: int | None = None) -> int:
    """Query heads a CTA serves for `programs` (batch x latent blocks) on `sms` SMs: 128 ("heads" mode: each compute
    warpgroup 64 of them over every KV tile, so a tile is loaded once for 128 heads; MLRA's blocks under TP serve
    all of DeepSeek-V3's 128 heads) where the latent fits "tiles" (r <= 256), the heads come in whole 128s and CTAs
    of 64 heads would not fit in one wave; else 64. In one wave, 64 heads a CTA over a whole range is faster than
    128 over half of it and a split-KV merge (`mlra bench latent_kernel heads`). `requested` (64 or 128)
    overrides."""
    pair = COMPUTE_WGS * HEADS
    if requested is None:
        return pair if r <= 256 and heads % pair == 0 and programs * (heads // HEADS) > sms else HEADS
    if requested not in (HEADS, pair) or (requested > HEADS and (r > 256 or heads % requested)):
        raise ValueError(
            f"cta_heads={requested}: the kernel takes {HEADS}, or {pair} for a multiple of {pair} heads and latent "
            f"widths up to 256 (got {heads} heads, width {r})"
        )
    return requested


def sm_count(device: jax.Device | None = None) -> int:
    """The GPU's streaming multiprocessors (the device's `core_count`: 132 on an H100 SXM, 114 on an H100 PCIe),
    DEFAULT_SMS where the device reports none."""
    device = device if device is not None else jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_SMS


def launch_plan(
    programs: int, slots: int, split_keys: int, by_columns: bool, paged: bool, sms: int, splits: int | None = None
) -> tuple[int, int]:
    """(KV splits, halves) for `programs` (batch x blocks x head groups) over `sms` SMs: enough splits to fill
    the GPU, each of at least `split_keys` keys (or `splits` as given). "halves": where the "columns" CTAs fill at
    most half the GPU (MLA at batch 1 and a short context), two CTAs per KV split take half the value columns each,
    their warpgroups alternating tiles as in "tiles" mode, on twice the SMs."""
    splits = splits or choose_splits(programs, slots, split_keys, sms)
    halves = 2 if by_columns and not paged and 2 * splits * programs <= sms else 1
    return splits, halves


KERNEL_OPTIONS = ("scale", "splits", "block_kv", "cta_heads", "interpret")


@functools.partial(jax.jit, static_argnames=KERNEL_OPTIONS)
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
    cta_heads: int | None = None,
    page_table: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q_rope [B, N, H, Dr], q_latent [B, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R] -> [B, N, H, R];
    or a paged cache k_rope [P, page, Dr], latent [P, page, N, R] with page_table [B, S / page]. cta_heads: query
    heads per CTA (`heads_per_cta`); interpret=True runs both kernels in Pallas's GPU interpret mode (on CPU, for
    the tests: see latent_partials_gpu)."""
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
        cta_heads=cta_heads,
        page_table=page_table,
        interpret=interpret,
    )
    heads = q_rope.shape[2]
    if out.shape[2] == 1 or out.shape[-1] % COMBINE_COLUMNS:  # one split: a slice; odd widths: XLA's combine
        return combine(out, lse, latent.dtype)[:, :, :heads]
    return combine_gpu(out, lse, latent.dtype, heads, sms=sm_count(), interpret=interpret)


def combine_heads(partial_shape: tuple[int, ...], heads: int, sms: int) -> int:
    """Heads per CTA of the split-KV merge of partials [B, N, P, H', R] into `heads` heads: the largest power of two
    up to COMBINE_HEADS that divides `heads` and leaves at least one CTA per SM (at batch 1 a CTA per row)."""
    b, n, _, _, r = partial_shape
    row_ctas = heads * (r // COMBINE_COLUMNS) * b * n  # a CTA per head's row of COMBINE_COLUMNS values
    rows = COMBINE_HEADS
    while rows > 1 and (heads % rows or row_ctas // rows < sms):
        rows //= 2
    return rows


def combine_gpu(
    partial_out: jax.Array,
    partial_lse: jax.Array,
    dtype: jnp.dtype,
    heads: int,
    *,
    sms: int = DEFAULT_SMS,
    heads_per_cta: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """latent_decode_common.combine as one Mosaic GPU kernel (the same result; XLA takes four kernels, launch-bound
    at batch 1): partials out [B, N, P, H', R] and lse [B, N, P, H'] -> [B, N, heads, R]. A CTA merges
    `combine_heads` heads' rows (or `heads_per_cta`, a divisor of `heads`) of COMBINE_COLUMNS values over the P
    splits (on `sms` SMs), every load issued first: the weights are scalars, the rows 128-wide vectors (one value
    per thread). interpret=True runs it in GPU interpret mode (on CPU, for the tests)."""
    b, n, p, _, r = partial_out.shape
    rows = heads_per_cta or combine_heads(partial_out.shape, heads, sms)
    if heads % rows:
        raise ValueError(f"heads_per_cta={rows} does not divide the {heads} heads")

    def kernel(out_ref, lse_ref, merged_ref):
        column, head_rows, bn = lax.axis_index("column"), lax.axis_index("head_rows"), lax.axis_index("bn")
        bi, ni, cols = bn // n, lax.rem(bn, n), pl.ds(column * COMBINE_COLUMNS, COMBINE_COLUMNS)
        first = head_rows * rows
        values = [[out_ref[bi, ni, split, first + k, cols] for split in range(p)] for k in range(rows)]
        lses = [[lse_ref[bi, ni, split, first + k] for split in range(p)] for k in range(rows)]
        for k in range(rows):
            top = functools.reduce(jnp.maximum, lses[k])
            top = jnp.where(top == -jnp.inf, 0.0, top)  # every split empty: zero weights, a zero output
            acc, total = jnp.zeros((COMBINE_COLUMNS,), jnp.float32), jnp.float32(0)
            for row, lse in zip(values[k], lses[k]):
                weight = jnp.exp2(lse - top)
                acc = acc + row.astype(jnp.float32) * weight
                total = total + weight
            merged_ref[bi, ni, first + k, cols] = (acc * (1.0 / jnp.maximum(total, 1e-30))).astype(dtype)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b, n, heads, r), dtype),
        grid=(r // COMBINE_COLUMNS, heads // rows, b * n),
        grid_names=("column", "head_rows", "bn"),
        interpret=interpret_params(interpret),
    )(partial_out, partial_lse)


@functools.partial(jax.jit, static_argnames=KERNEL_OPTIONS)
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
    cta_heads: int | None = None,
    page_table: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel alone: split-KV partials out [B, N, P, H', R] (normalized) and log2-sum-exp [B, N, P, H']
    (H' = H, or H padded to whole CTAs' heads), merged by latent_decode_common.combine.

    interpret=True (Pallas's GPU interpret mode on CPU, for the tests) runs the threads, barriers, TMA copies, the
    pipeline and the stores as on the GPU, and the products as float32 dots of the SMEM tiles with plain register
    layouts (mlra_attention_gpu's `_scores` and `_values`); it takes float32 inputs too."""
    b, n, h, dr = q_rope.shape
    r = latent.shape[3]
    dtype = latent.dtype
    allowed = (jnp.bfloat16, jnp.float16, jnp.float32) if interpret else (jnp.bfloat16, jnp.float16)
    if dtype not in allowed or dr % CHUNK or r % CHUNK:
        raise ValueError(
            f"the Mosaic GPU latent kernel takes {', '.join(map(str, allowed))} with RoPE and latent widths that are "
            f"multiples of {CHUNK}; got {dtype}, {dr}, {r}"
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
    sms = sm_count()
    cta_heads = heads_per_cta(h, r, b * n, sms, cta_heads)
    head_wgs = cta_heads // HEADS  # 2 in "heads" mode: warpgroup w serves the CTA's heads w * 64 ..
    groups = pl.cdiv(h, cta_heads)
    # Query rows a warpgroup loads and stores. Fewer than 64 heads (GLA-2's 32) fill the first rows of the
    # 64-row tile (the rest are never stored); other head counts are padded to whole CTAs' heads.
    rows = h if h < HEADS and h % 8 == 0 else HEADS
    padded = groups * rows * head_wgs
    if padded != h:
        pad = ((0, 0), (0, 0), (0, padded - h), (0, 0))
        q_rope, q_latent = jnp.pad(q_rope, pad), jnp.pad(q_latent, pad)
    by_columns, block_kv, stages = _plan(dr, r, block_kv, cta_heads)
    # A paged KV tile is made of whole pages (page <= tile) or lies inside one page (page > tile).
    if page and max(page, block_kv) % min(page, block_kv):
        raise ValueError(
            f"pages of {page} slots do not tile into the kernel's KV tiles of {block_kv}; pass "
            f"block_kv=64 or use pages of a multiple of {block_kv}"
        )
    tile_pages, page_rows = (block_kv // page, page) if 0 < page <= block_kv else (1, block_kv)
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    split_keys = block_kv if head_wgs > 1 else block_kv * COMPUTE_WGS  # a tile per warpgroup at least
    splits, halves = launch_plan(b * n * groups, s, split_keys, by_columns, paged, sms, splits)
    by_columns = by_columns and halves == 1
    every_tile = by_columns or head_wgs > 1  # both warpgroups read every tile ("columns", "heads")
    wg_chunks = lat_chunks // COMPUTE_WGS if by_columns else lat_chunks // halves  # value chunks per warpgroup
    # Interpret mode ignores transforms; float32 (interpret only) has none.
    tile_transforms = (
        (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128)) if jnp.dtype(dtype).itemsize == 2 else ()
    )

    def kernel(starts_ref, ends_ref, pages_ref, qr_ref, ql_ref, kr_ref, lat_ref, o_ref, lse_ref, scoped):
        (qr_smem, ql_smem, kr_smem, lat_smem, lse_smem, alpha_smem), barriers = scoped
        q_barrier, kv_barriers, consumed, done, stored, p_ready = barriers
        split, block_head, bi = lax.axis_index("split"), lax.axis_index("block_head"), lax.axis_index("batch")
        half, block_head = lax.rem(block_head, halves), block_head // halves
        ni, first_head = block_head // groups, (block_head % groups) * cta_heads
        loaded = pl.ds(0, rows)  # the SMEM rows that hold (and return) a warpgroup's heads
        wg = lax.axis_index("wg")
        qw = wg if head_wgs > 1 else 0  # the warpgroup's query tile ("heads"), else the CTA's one
        start, end = starts_ref[bi], ends_ref[bi]
        first, last = start // block_kv, (end + block_kv - 1) // block_kv
        per_split = (last - first + splits - 1) // splits
        t0 = first + split * per_split
        steps = jnp.maximum(jnp.minimum(t0 + per_split, last) - t0, 0)

        def heads_of(tile):
            return pl.ds(first_head + tile * HEADS, rows)

        def write_out(outs, lse, first_chunk, store_lse, first_column=None):
            """outs through the warpgroup's query SMEM, chunks first_chunk.., to the value chunks first_column.. (the
            same by default) of its heads' output; the lse too where store_lse (the first half's CTA stores it)."""
            first_column = first_chunk if first_column is None else first_column
            for j, o in enumerate(outs):
                ql_smem.at[qw, first_chunk + j][...] = o.astype(dtype)
            if store_lse:
                lse_smem.at[wg][...] = lse
            plgpu.commit_smem()
            for j in range(len(outs)):
                plgpu.copy_smem_to_gmem(
                    ql_smem.at[qw, first_chunk + j, loaded],
                    o_ref.at[bi, ni, split, heads_of(qw), pl.ds((first_column + j) * CHUNK, CHUNK)],
                )
            if store_lse:
                pl.when(half == 0)(
                    lambda: plgpu.copy_smem_to_gmem(lse_smem.at[wg, loaded], lse_ref.at[bi, ni, split, heads_of(qw)])
                )
            plgpu.wait_smem_to_gmem(0)

        def softmax_step(step, slot, accs, m_i, l_i):
            """One KV tile's scores (the warpgroup's query tile against the slot's keys), masked to the range, and the
            online softmax: (P, the running output's rescale alpha, rescaled accs, m, l)."""

            def key_tiles():
                rope = [(qr_smem.at[qw, c], kr_smem.at[slot, c]) for c in range(rope_chunks)]
                return rope + [(ql_smem.at[qw, c], lat_smem.at[slot, c]) for c in range(lat_chunks)]

            qk = _scores(key_tiles, None, interpret, block_kv)
            slots = _columns((HEADS, block_kv), interpret) + (t0 + step) * block_kv
            qk = jnp.where((slots >= start) & (slots < end), qk * (scale * LOG2E), -jnp.inf)
            m_new = jnp.maximum(m_i, qk.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(qk - lax.broadcast_in_dim(m_new, qk.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            return p.astype(dtype), alpha, rescaled(accs, alpha), m_new, l_i

        def rescaled(accs, alpha):
            return tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs)

        def normalized(accs, l_i):
            l_safe = jnp.maximum(l_i, 1e-30)  # an empty range has l = 0, a zero output and lse = -inf
            return [acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0]) for acc in accs], jnp.log2(l_safe)

        def columns_schedule(accs, m_i, l_i, reduced):
            """The "columns" schedule (MLA's 512-wide latent): warpgroup 0 computes each tile's scores and softmax
            once and hands P and the rescale to warpgroup 1 through SMEM (P over the slot's RoPE key tile, which it
            has read and warpgroup 1 never reads); each takes P V on half the value columns, as FlashMLA splits them.
            The slot is refilled once both have arrived on `consumed`."""

            @pl.when(wg == 0)
            def _scores_and_values():
                def kv_step(step, carry):
                    accs, m_i, l_i = carry
                    slot = lax.rem(step, jnp.int32(stages))
                    plgpu.barrier_wait(kv_barriers.at[slot])
                    p16, alpha, accs, m_i, l_i = softmax_step(step, slot, accs, m_i, l_i)
                    kr_smem.at[slot, 0][...] = p16
                    alpha_smem.at[slot][...] = alpha
                    plgpu.commit_smem()  # P is read by warpgroup 1's wgmma (the async proxy)
                    plgpu.barrier_arrive(p_ready.at[slot])
                    values = lambda: [lat_smem.at[slot, j] for j in range(wg_chunks)]
                    accs = _values(accs, p16, values, interpret)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return accs, m_i, l_i

                accs_, m_, l_ = lax.fori_loop(0, steps, kv_step, (accs, m_i, l_i))
                lse_smem.at[1][...] = l_
                plgpu.barrier_arrive(stored.at[0])
                plgpu.barrier_arrive(done.at[0])
                plgpu.barrier_wait(done.at[0])
                outs, log_l = normalized(accs_, l_)
                write_out(outs, m_ + log_l, 0, store_lse=True)

            @pl.when(wg == 1)
            def _values_only():
                def kv_step(step, accs):
                    slot = lax.rem(step, jnp.int32(stages))
                    plgpu.barrier_wait(kv_barriers.at[slot])
                    plgpu.barrier_wait(p_ready.at[slot])
                    accs = rescaled(accs, _smem_read(alpha_smem.at[slot], reduced, interpret))
                    values = lambda: [lat_smem.at[slot, wg_chunks + j] for j in range(wg_chunks)]
                    accs = _values_from_smem(accs, lambda: kr_smem.at[slot, 0], values, interpret)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return accs

                accs_ = lax.fori_loop(0, steps, kv_step, accs)
                plgpu.barrier_arrive(done.at[0])
                plgpu.barrier_wait(done.at[0])
                plgpu.barrier_wait(stored.at[0])
                outs, _ = normalized(accs_, _smem_read(lse_smem.at[1], reduced, interpret))
                write_out(outs, None, wg_chunks, store_lse=False)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")  # FA3's split: two compute, one memory warpgroup
            plgpu.barrier_wait(q_barrier.at[0])
            reduced = plgpu.Layout.WGMMA.reduce(1)
            m_i = _layout(jnp.full((HEADS,), -jnp.inf, jnp.float32), reduced, interpret)
            l_i = _layout(jnp.full((HEADS,), 0, jnp.float32), reduced, interpret)
            accs = tuple(
                _layout(jnp.full((HEADS, CHUNK), 0, jnp.float32), plgpu.Layout.WGMMA, interpret)
                for _ in range(wg_chunks)
            )

            if by_columns:
                columns_schedule(accs, m_i, l_i, reduced)
                return

            def kv_step(i, carry):
                accs, m_i, l_i = carry
                step = i if every_tile else i * COMPUTE_WGS + wg  # "tiles": warpgroup w takes w, w + 2, ...
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(kv_barriers.at[slot])
                p16, _, accs, m_i, l_i = softmax_step(step, slot, accs, m_i, l_i)
                values = lambda: [lat_smem.at[slot, half * wg_chunks + j] for j in range(len(accs))]
                accs = _values(accs, p16, values, interpret)
                plgpu.barrier_arrive(consumed.at[slot])
                return accs, m_i, l_i

            my_steps = steps if every_tile else (steps - wg + COMPUTE_WGS - 1) // COMPUTE_WGS
            accs, m_i, l_i = lax.fori_loop(0, my_steps, kv_step, (accs, m_i, l_i))
            # Both warpgroups are done reading the query before outputs overwrite its SMEM.
            plgpu.barrier_arrive(done.at[0])
            plgpu.barrier_wait(done.at[0])
            outs, log_l = normalized(accs, l_i)
            lse = m_i + log_l

            if head_wgs > 1:  # each warpgroup its own heads
                write_out(outs, lse, 0, store_lse=True)
            else:  # two softmax states over disjoint tiles: warpgroup 1 hands its one to 0 through SMEM

                @pl.when(wg == 1)
                def _hand_over():
                    for j, o in enumerate(outs):
                        ql_smem.at[0, j][...] = o.astype(dtype)
                    lse_smem.at[1][...] = lse
                    plgpu.barrier_arrive(stored.at[0])

                @pl.when(wg == 0)
                def _merge():
                    plgpu.barrier_wait(stored.at[0])
                    other_lse = _smem_read(lse_smem.at[1], reduced, interpret)
                    top = jnp.maximum(lse, other_lse)
                    top = jnp.where(top == -jnp.inf, 0.0, top)
                    mine, other = jnp.exp2(lse - top), jnp.exp2(other_lse - top)
                    total = mine + other  # 0 where both ranges were empty
                    inverse = 1.0 / jnp.maximum(total, 1e-30)
                    mine, other = mine * inverse, other * inverse
                    merged = [
                        o * lax.broadcast_in_dim(mine, o.shape, [0])
                        + _smem_read(ql_smem.at[0, j], plgpu.Layout.WGMMA, interpret).astype(jnp.float32)
                        * lax.broadcast_in_dim(other, o.shape, [0])
                        for j, o in enumerate(outs)
                    ]
                    write_out(merged, top + jnp.log2(total), 0, store_lse=True, first_column=half * wg_chunks)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for q in range(head_wgs):
                for c in range(rope_chunks):
                    plgpu.copy_gmem_to_smem(
                        qr_ref.at[bi, ni, heads_of(q), pl.ds(c * CHUNK, CHUNK)],
                        qr_smem.at[q, c, loaded],
                        q_barrier.at[0],
                    )
                for c in range(lat_chunks):
                    plgpu.copy_gmem_to_smem(
                        ql_ref.at[bi, ni, heads_of(q), pl.ds(c * CHUNK, CHUNK)],
                        ql_smem.at[q, c, loaded],
                        q_barrier.at[0],
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
            plgpu.SMEM((head_wgs, rope_chunks, HEADS, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((head_wgs, lat_chunks, HEADS, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((stages, rope_chunks, block_kv, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((stages, lat_chunks, block_kv, CHUNK), dtype, transforms=tile_transforms),
            plgpu.SMEM((COMPUTE_WGS, HEADS), jnp.float32),
            plgpu.SMEM((stages, HEADS), jnp.float32),  # "columns": each tile's rescale, handed to warpgroup 1
        )
        copies = rope_chunks + lat_chunks
        barriers = (
            plgpu.Barrier(num_arrivals=copies * head_wgs, num_barriers=1),
            plgpu.Barrier(num_arrivals=copies * tile_pages, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS if every_tile else 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # "columns": a tile's P and rescale are in SMEM
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    out, lse = plgpu.kernel(
        entry,
        out_type=[
            jax.ShapeDtypeStruct((b, n, splits, padded, r), dtype),
            jax.ShapeDtypeStruct((b, n, splits, padded), jnp.float32),
        ],
        grid=(splits, n * groups * halves, b),
        grid_names=("split", "block_head", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), page_table.astype(jnp.int32), q_rope, q_latent, k_rope, latent)
    return out, lse


def _values_from_smem(accs: tuple, p_tile, values, interpret: bool) -> tuple:
    """accs[c] + P values()[c], P the [64, block_kv] tile p_tile() in SMEM (wgmma with A from SMEM; both indexed
    inside the accumulators' scope, as mlra_attention_gpu's `_values`)."""
    if interpret:
        return _values(accs, p_tile()[...], values, interpret)

    def body(acc_refs):
        for acc_ref, v in zip(acc_refs, values()):
            plgpu.wgmma(acc_ref, p_tile(), v)

    return pl.run_state(body)(tuple(plgpu.ACC.init(a) for a in accs))


def _smem_read(ref, layout, interpret: bool) -> jax.Array:
    """An SMEM tile read into registers in `layout` (plain in interpret mode); a reduced (1-D) layout's read is not
    vectorized."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=layout, optimized=layout == plgpu.Layout.WGMMA)
