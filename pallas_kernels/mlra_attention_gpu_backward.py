"""MLRA's causal training attention, backward, as Pallas Mosaic GPU kernels for Hopper, and `mlra_attention`: the
forward (mlra_attention_gpu) and this backward under jax.custom_vjp, so that jax.grad runs through both kernels.

Per latent block j and query head h (mlra_attention_gpu's notation; s_j the scaled logits, P_j its causal softmax,
O_j = P_j latent_j, dO_j the output's cotangent):

    D_j = rowsum(dO_j * O_j),   dP_j = dO_j latent_j^T,   dS_j = scale * P_j * (dP_j - D_j),
    d q_latent_j = dS_j latent_j,   d q_rope = sum_j dS_j k_rope,
    d latent_j = sum_h (dS_j^T q_latent_j + P_j^T dO_j),   d k_rope = sum_j sum_h dS_j^T q_rope.

The latent block is its branch's key and its value, so its two gradients share one accumulator. With head groups
(mlra_attention_gpu's `groups`), block c G + g serves branch c of group g's heads.

Design (FlashAttention-2's backward, as jax.experimental.pallas.ops.gpu.attention_mgpu's, made causal):
  * D (and the logsumexp in the log2 domain) in jnp before the kernels: one fused XLA reduction.
  * dK/dV kernel: a CTA takes one (latent block, 128 keys, sequence): two compute warpgroups of 64 keys each hold
    their key tile [latent || k_rope] in SMEM and the accumulators d latent (R columns) and d k_rope (Dr); the
    memory warpgroup streams the query tiles of 64 rows at or after the CTA's diagonal (causal tile skipping: the
    tiles above it are never loaded) through `stages` SMEM slots: q_latent, q_rope, dO, the logsumexp and D. It
    walks them from the sequence's last tile down to the diagonal, each tile for every query head of the block in
    turn, so that the CTAs of one block and sequence, which start together, read the same tiles at the same time.
    Per tile: S^T and dP^T (wgmma, B transposed, one wait), P^T, dS^T, then P^T dO, dS^T q_latent (both onto d
    latent) and dS^T q_rope (A from registers). The two diagonal tiles come last and are masked; the second
    warpgroup only observes and releases the first (wholly above its keys). d k_rope leaves per block and is
    summed over the blocks in XLA.
  * The dK/dV kernel also stores each dS^T tile it computes (bf16, 64 keys by 64 queries, only the causal half's
    tiles, packed row by row: B x n G x H x T^2 / 2 values), through two SMEM buffers a warpgroup and TMA stores
    that run under the next tile's products (`stored_ds`, the default).
  * dQ kernel: a CTA takes one (latent block, query head, 128 queries, sequence): the memory warpgroup streams key
    tiles of 64 up to the diagonal with both warpgroups' dS^T tiles (the first warpgroup observes and releases the
    tile past its diagonal), and each warpgroup adds dS [latent || k_rope] (dS^T read transposed by wgmma): 192
    multiply-adds per query, key and head. Without stored_ds the compute warpgroups hold their rows' q_latent,
    q_rope, dO, logsumexp and D and recompute S and dP (one wait), P and dS per tile first (512). d q_rope leaves
    per block and is summed in XLA.
  Every warpgroup's accumulators: 64 + 64 + R + Dr float32 columns (BACKWARD_COLUMNS bounds R + Dr). The per-block
  RoPE gradients are written in the inputs' dtype and summed in float32.
  * The scale is folded into the inputs computed in XLA: the dK/dV kernel takes scale * D, the dQ kernel the
    logsumexp less log2(scale) (exp2 gives scale * P).
  * `BackwardTuning` (`tuning=`): either kernel's pipeline depth, dS stored or recomputed, and the older
    schedules (the dK/dV walk head by head, every warpgroup masking the first two tiles of each head, the scale
    applied in the kernels) for A/Bs; the benchmark's `--mlra_backward` times them side by side.

On an H200 (jax 0.11; experiments/results/attention_kernels_mlra_stored_ds_h200.json) MLRA-4 2.9B's layer ran
forward (the default tiling) + backward 1.36x cuDNN's forward + backward on the same inputs at batch 8 (1.23x with dS
recomputed); ptxas spilled 12 and 16 bytes a thread in the two recomputing kernels at R = 128 on an H100.

Interpret mode (`interpret=True`, on CPU) runs it as the forward's docstring describes, the products as float32
dots of the same SMEM operands (`_mma`). Float32 inputs run only in interpret mode; the GPU takes bf16 or f16.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from mlra_jax.pallas_kernels.gpu_interpret import interpret_params
from mlra_jax.pallas_kernels.mlra_attention_gpu import (
    BLOCK_KV,
    CHUNK,
    COMPUTE_WGS,
    LOG2E,
    SMEM_BYTES,
    _layout,
    mlra_attention_gpu,
    stream_tiles,
)
from mlra_jax.pallas_kernels.remat_names import MLRA_ATTENTION_RESIDUALS

TILE = 64  # rows of every tile: a warpgroup's keys (dK/dV) or queries (dQ), and the streamed tiles
BACKWARD_COLUMNS = 192  # R + Dr at most: with S and dP, 320 float32 accumulator columns per warpgroup
MAX_STAGES = 4


class BackwardTuning(NamedTuple):
    """Schedules of the two backward kernels; the defaults are the fastest measured (the module's docstring).

    dkv_stages, dq_stages: pipeline slots of the streamed tiles (None: as many as fit SMEM, at most MAX_STAGES;
      a number: that many, at least 2, ValueError where they do not fit).
    skip_masked: in the dK/dV kernel the second warpgroup only observes and releases each head's first tile (wholly
      above its keys; without lockstep the first warpgroup's second tile also runs unmasked). False: both
      warpgroups run the first two tiles masked (the second's first tile adds zeros).
    prescale: the scale folded into the inputs computed in XLA: the dK/dV kernel takes scale * D and computes
      dS^T = P^T (scale dP^T - scale D); the dQ kernel takes the logsumexp less log2(scale), so that exp2 gives
      scale * P and dS = (scale P) (dP - D). False: the kernels compute dS = (P scale) (dP - D).
    lockstep: the dK/dV kernel walks the query tiles from the sequence's last down to the CTA's diagonal, every
      head's tile in turn, so that the CTAs of one block and sequence that start together read the same tiles at
      the same time (once from HBM, then from L2). False: each head's tiles in turn, from the diagonal on (the
      CTAs drift apart after the first head).
    stored_ds: the dK/dV kernel stores dS (bf16, the causal half's 64 x 64 tiles) and the dQ kernel reads it (dS K
      per key tile) instead of recomputing S, P, dP and dS: 832 multiply-adds per query, key and head instead of
      1,152, for B H T^2 bytes written and read. Takes lockstep and skip_masked (parse turns it off with either
      unless it is asked for).
    """

    dkv_stages: int | None = None
    dq_stages: int | None = None
    skip_masked: bool = True
    prescale: bool = True
    lockstep: bool = True
    stored_ds: bool = True

    @classmethod
    def parse(cls, spec: str) -> "BackwardTuning":
        """A tuning from words joined by '+': default, noskip, noprescale, nolockstep (the older schedules), skip,
        prescale, lockstep (the defaults, explicitly), stored_ds or recomputed_ds, stagesN (both kernels),
        dkv_stagesN, dq_stagesN; e.g. 'noskip+noprescale' or 'dq_stages3'."""
        fields: dict = {}
        switches = {"skip": ("skip_masked", True), "noskip": ("skip_masked", False)}
        switches |= {"prescale": ("prescale", True), "noprescale": ("prescale", False)}
        switches |= {"lockstep": ("lockstep", True), "nolockstep": ("lockstep", False)}
        switches |= {"stored_ds": ("stored_ds", True), "recomputed_ds": ("stored_ds", False)}
        for word in spec.split("+"):
            if word == "default":
                continue
            if word in switches:
                field, value = switches[word]
                fields[field] = value
            elif (match := re.fullmatch(r"(dkv_|dq_)?stages(\d+)", word)) is not None:
                for kernel in (match.group(1),) if match.group(1) else ("dkv_", "dq_"):
                    fields[f"{kernel}stages"] = int(match.group(2))
            else:
                raise ValueError(
                    f"backward tuning {spec!r}: {word!r} is none of default, skip, noskip, prescale, noprescale, "
                    "lockstep, nolockstep, stored_ds, recomputed_ds, stagesN, dkv_stagesN, dq_stagesN"
                )
        if not (fields.get("lockstep", True) and fields.get("skip_masked", True)):
            fields.setdefault("stored_ds", False)
        tuning = cls(**fields)
        tuning.check()
        return tuning

    def check(self) -> None:
        """ValueError for a combination the kernels do not run."""
        if self.stored_ds and not (self.lockstep and self.skip_masked):
            raise ValueError("the backward's stored_ds takes lockstep and skip_masked (stored_ds=False runs either)")


class _Reg(NamedTuple):
    """A wgmma A operand held in registers (the others are SMEM refs)."""

    value: jax.Array


class _Transposed(NamedTuple):
    """A wgmma A operand read transposed from an SMEM ref."""

    ref: object


def _mma(inits: tuple[jax.Array, ...], terms: Callable[[], list], interpret: bool) -> tuple[jax.Array, ...]:
    """inits[i] + the sum of a b (b^T where transposed) over terms() = [(i, a, b, transposed)], a an SMEM ref or a
    _Reg, b an SMEM ref: wgmma into accumulators initialized from inits, all awaited once, on the GPU; float32 dots
    of the same operands in interpret mode. terms() is called inside the accumulators' scope (see `_scores` in
    mlra_attention_gpu: views made outside fail to lower)."""
    if interpret:
        accs = list(inits)
        for i, a, b, transposed in terms():
            lhs = a.value if isinstance(a, _Reg) else a.ref[...].T if isinstance(a, _Transposed) else a[...]
            dims = (((1,), (1 if transposed else 0,)), ((), ()))
            accs[i] = accs[i] + lax.dot_general(
                lhs, b[...], dims, precision="highest", preferred_element_type=jnp.float32
            )
        return tuple(accs)

    def operand(a):
        if isinstance(a, _Reg):
            return a.value
        return plgpu.transpose_ref(a.ref, (1, 0)) if isinstance(a, _Transposed) else a

    def body(refs):
        for i, a, b, transposed in terms():
            plgpu.wgmma(refs[i], operand(a), plgpu.transpose_ref(b, (1, 0)) if transposed else b)

    return tuple(pl.run_state(body)(tuple(plgpu.ACC.init(x) for x in inits)))


def _zeros(shape: tuple[int, int], interpret: bool) -> jax.Array:
    return _layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA, interpret)


def _vector(ref, axis: int, interpret: bool) -> jax.Array:
    """A [TILE] float32 vector from SMEM in the layout of a WGMMA tile reduced over `axis`."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(axis))


def _iota(shape: tuple[int, int], dim: int, interpret: bool) -> jax.Array:
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _stages(resident: int, streamed: int, requested: int | None = None) -> int:
    """Pipeline slots of `streamed` bytes beside `resident` bytes of SMEM: `requested` (ValueError where they do not
    fit), else as many as fit up to MAX_STAGES; at least two."""
    fit = (SMEM_BYTES - resident) // streamed
    if fit < 2:
        raise ValueError("the backward's tiles do not fit shared memory twice")
    if requested is None:
        return min(fit, MAX_STAGES)
    if not 2 <= requested <= fit:
        raise ValueError(f"stages={requested}: the backward's pipeline takes 2 to {fit} slots of its tiles here")
    return requested


def packed(query_tile, key_tile):
    """The place of the 64 x 64 tile (query_tile >= key_tile) in the causal half's tiles, row by row (with
    key_tile = 0, query_tile past the last: their count)."""
    return query_tile * (query_tile + 1) // 2 + key_tile


def _dq_cta(heads: int, groups: int, q_tiles: int) -> tuple:
    """A dQ CTA's (sequence, warpgroup, branch, query head, latent block, query tile, key tiles of its last rows):
    branch c of head hi (group hi // H) reads block c G + hi // H; the longest rows first."""
    head, bi, wg = lax.axis_index("head"), lax.axis_index("batch"), lax.axis_index("wg")
    j, hi = head // heads, lax.rem(head, heads)
    q_tile = q_tiles - 1 - lax.axis_index("q_tile")
    return bi, wg, j, hi, j * groups + hi // (heads // groups), q_tile, (q_tile + 1) * COMPUTE_WGS


def _skip_past_diagonal(kv_barriers, consumed, stages: int, steps, max_steps) -> None:
    """The dQ kernels' first warpgroup: the key tiles past its diagonal (steps .. max_steps), observed and released."""

    @pl.loop(steps, max_steps)
    def _skipped(i):
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(kv_barriers.at[slot])
        pl.when(i + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[slot]))


def _dq_launch(entry, q_shape: tuple[int, ...], dr: int, dtype, interpret: bool):
    """Either dQ kernel's launch: a CTA per (latent block and query head, 128 queries, sequence) of q_latent's shape
    [G H, B, T, n, R], writing d q_latent in that shape and the per-branch d q_rope [B, n, T, G H, Dr]."""
    heads, b, t, n, _ = q_shape
    return plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct((b, n, t, heads, dr), dtype)],
        grid=(n * heads, t // (COMPUTE_WGS * TILE), b),
        grid_names=("head", "q_tile", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
    )


def _write_dq(accs, lat_smem, rope_smem, dql_ref, dqr_ref, at: tuple, dtype) -> None:
    """A warpgroup's d q_latent and d q_rope accumulators out through its SMEM tiles (lat_smem, rope_smem: its
    chunks); at = (head, sequence, rows, branch)."""
    hi, bi, rows, j = at
    lat_chunks = len(accs) - rope_smem.shape[0]
    for c, acc in enumerate(accs):
        (lat_smem.at[c] if c < lat_chunks else rope_smem.at[c - lat_chunks])[...] = acc.astype(dtype)
    plgpu.commit_smem()
    for c in range(lat_chunks):
        plgpu.copy_smem_to_gmem(lat_smem.at[c], dql_ref.at[hi, bi, rows, j, pl.ds(c * CHUNK, CHUNK)])
    for c in range(len(accs) - lat_chunks):
        plgpu.copy_smem_to_gmem(rope_smem.at[c], dqr_ref.at[bi, j, rows, hi, pl.ds(c * CHUNK, CHUNK)])
    plgpu.wait_smem_to_gmem(0)


def _fetch_keys(lat_ref, kr_ref, lat_smem, kr_smem, barrier, bi, i, block) -> None:
    """Key tile i (64 rows of latent block `block` and of k_rope, sequence bi) into one slot's SMEM tiles."""
    keys = pl.ds(i * TILE, TILE)
    for c in range(lat_smem.shape[0]):
        plgpu.copy_gmem_to_smem(lat_ref.at[bi, keys, block, pl.ds(c * CHUNK, CHUNK)], lat_smem.at[c], barrier)
    for c in range(kr_smem.shape[0]):
        plgpu.copy_gmem_to_smem(kr_ref.at[bi, keys, pl.ds(c * CHUNK, CHUNK)], kr_smem.at[c], barrier)


def _transforms(dtype) -> tuple:
    if jnp.dtype(dtype).itemsize == 2:
        return (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128))
    return ()


def _dkv(ql, qr, lat, kr, do, lse2, delta, *, scale: float, groups: int, tuning: BackwardTuning, interpret: bool):
    """d latent [B, S, n G, R] and the per-block d k_rope [B, n G, S, Dr] (to be summed over the blocks). delta: D,
    or scale * D under tuning.prescale."""
    heads, b, t, n, r = ql.shape
    h = heads // groups  # the query heads of each block
    dr, dtype = kr.shape[-1], lat.dtype
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    kv_tiles = t // (COMPUTE_WGS * TILE)
    size = jnp.dtype(dtype).itemsize
    # dS tiles on their way out, 2 a warpgroup (counted as bf16: float32 runs only in interpret mode)
    staging = COMPUTE_WGS * 2 * TILE * TILE * min(size, 2) if tuning.stored_ds else 0
    resident = COMPUTE_WGS * TILE * (r + dr) * size + staging
    stages = _stages(resident, TILE * ((2 * r + dr) * size + 8), tuning.dkv_stages)
    scale_log2, transforms = scale * LOG2E, _transforms(dtype)
    shape = (TILE, TILE)

    def kernel(ql_ref, qr_ref, lat_ref, kr_ref, do_ref, lse_ref, delta_ref, dlat_ref, dkr_ref, *rest):
        *ds_out, scoped = rest
        (klat_smem, kkr_smem, ql_smem, qr_smem, do_smem, lse_smem, delta_smem, *ds_smem), barriers = scoped
        k_barriers, q_barriers, consumed = barriers
        j, bi, wg = lax.axis_index("block"), lax.axis_index("batch"), lax.axis_index("wg")
        branch, first_head = j // groups, lax.rem(j, groups) * h  # block c G + g: branch c of heads g H ..
        kv_tile = lax.axis_index("kv_tile")
        first = kv_tile * COMPUTE_WGS  # the first query tile at or after the CTA's first key
        per_head = t // TILE - first
        total = h * per_head

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
                """P^T and dS^T of one query tile from S^T and dP^T, in the inputs' dtype."""
                if masked:  # query q0 + column sees key k0 + row when q >= k
                    q0 = (first + local) * TILE
                    keep = _iota(shape, 1, interpret) + q0 >= _iota(shape, 0, interpret) + k0
                    s_t = jnp.where(keep, s_t, -jnp.inf)
                lse = _vector(lse_smem.at[slot], 0, interpret)
                p_t = jnp.exp2(s_t * scale_log2 - lax.broadcast_in_dim(lse, shape, [1]))
                d = lax.broadcast_in_dim(_vector(delta_smem.at[slot], 0, interpret), shape, [1])
                ds_t = p_t * (dp_t * scale - d) if tuning.prescale else (p_t * scale) * (dp_t - d)
                return p_t.astype(dtype), ds_t.astype(dtype)

            def release(i):  # the slot is refilled only while tiles remain to load: every phase is awaited
                pl.when(i + stages < total)(lambda: plgpu.barrier_arrive(consumed.at[lax.rem(i, jnp.int32(stages))]))

            def skipped(i):  # a tile wholly above this warpgroup's keys (skip_masked): observed and released
                plgpu.barrier_wait(q_barriers.at[lax.rem(i, jnp.int32(stages))])
                release(i)

            def store(i, local, ds16):  # dS^T of query tile qt and key tile kt into its place in the causal half
                qt, kt, buffer = first + local, kv_tile * COMPUTE_WGS + wg, lax.rem(i, 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the buffer's last store has read it
                ds_smem[0].at[wg, buffer][...] = ds16
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(ds_smem[0].at[wg, buffer], ds_out[0].at[bi, j, lax.rem(i, h), packed(qt, kt)])

            def step(i, local, carry, masked):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(q_barriers.at[slot])
                s_t, dp_t = _mma((_zeros(shape, interpret),) * 2, lambda: scores(slot), interpret)
                p16, ds16 = probabilities(s_t, dp_t, local, slot, masked)
                if tuning.stored_ds:
                    store(i, local, ds16)
                carry = _mma(carry, lambda: grads(slot, _Reg(p16), _Reg(ds16)), interpret)
                release(i)
                return carry

            unmasked, masked = functools.partial(step, masked=False), functools.partial(step, masked=True)

            def head(hi, carry):  # the head's query tiles from the CTA's diagonal on
                base = hi * per_head
                if not tuning.skip_masked:  # the first two tiles masked for both warpgroups
                    carry = lax.fori_loop(0, COMPUTE_WGS, lambda m, c: masked(base + m, m, c), carry)
                    return lax.fori_loop(COMPUTE_WGS, per_head, lambda m, c: unmasked(base + m, m, c), carry)

                @pl.loop(0, wg)
                def _above(m):
                    skipped(base + m)

                carry = step(base + wg, wg, carry, masked=True)  # the warpgroup's diagonal tile
                return lax.fori_loop(wg + 1, per_head, lambda m, c: unmasked(base + m, m, c), carry)

            def tile_of_heads(walk, carry, run):  # every head's tile local = per_head - 1 - walk, by `run`
                local = per_head - 1 - walk
                return lax.fori_loop(0, h, lambda hi, c: run(walk * h + hi, local, c), carry)

            accs = (_zeros((TILE, CHUNK), interpret),) * (lat_chunks + rope_chunks)
            if not tuning.lockstep:
                accs = lax.fori_loop(0, h, head, accs)
            else:  # the tiles below both warpgroups' keys, then the two diagonal tiles (local 1, then local 0)
                below = per_head - COMPUTE_WGS
                accs = lax.fori_loop(0, below, lambda w, c: tile_of_heads(w, c, unmasked), accs)
                # local 1: wholly below the first warpgroup's keys (masked anyway: the mask keeps it whole), the
                # second's diagonal
                accs = tile_of_heads(below, accs, masked)
                if tuning.skip_masked:  # local 0: the first warpgroup's diagonal, wholly above the second's keys
                    accs = lax.fori_loop(0, h * (1 - wg), lambda hi, c: masked((below + 1) * h + hi, 0, c), accs)

                    @pl.loop(0, h * wg)
                    def _above(hi):
                        skipped((below + 1) * h + hi)

                else:
                    accs = tile_of_heads(below + 1, accs, masked)
            for c in range(lat_chunks):
                klat_smem.at[wg, c][...] = accs[c].astype(dtype)
            for c in range(rope_chunks):
                kkr_smem.at[wg, c][...] = accs[lat_chunks + c].astype(dtype)
            plgpu.commit_smem()
            for c in range(lat_chunks):
                plgpu.copy_smem_to_gmem(klat_smem.at[wg, c], dlat_ref.at[bi, keys, j, pl.ds(c * CHUNK, CHUNK)])
            for c in range(rope_chunks):
                plgpu.copy_smem_to_gmem(kkr_smem.at[wg, c], dkr_ref.at[bi, j, keys, pl.ds(c * CHUNK, CHUNK)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(i, slot):
                if tuning.lockstep:  # tile per_head - 1 - i // h of head i % h
                    hi, local = first_head + lax.rem(i, h), per_head - 1 - i // h
                else:  # tile i % per_head of head i // per_head
                    hi, local = first_head + i // per_head, lax.rem(i, per_head)
                rows = pl.ds((first + local) * TILE, TILE)
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
        )
        if tuning.stored_ds:
            smem += (plgpu.SMEM((COMPUTE_WGS, 2, TILE, TILE), dtype, transforms=transforms),)
        barriers = (
            plgpu.Barrier(num_arrivals=lat_chunks + rope_chunks, num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=2 * lat_chunks + rope_chunks + 2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct(lat.shape, dtype), jax.ShapeDtypeStruct((b, n * groups, t, dr), dtype)]
    if tuning.stored_ds:  # dS^T per block and head, the causal half's tiles (packed) of 64 keys by 64 queries
        out_type.append(jax.ShapeDtypeStruct((b, n * groups, h, packed(t // TILE, 0), TILE, TILE), dtype))
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(n * groups, kv_tiles, b),
        grid_names=("block", "kv_tile", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
    )(ql, qr, lat, kr, do, lse2, delta)


def _dq(ql, qr, lat, kr, do, lse2, delta, *, scale: float, groups: int, tuning: BackwardTuning, interpret: bool):
    """d q_latent [G H, B, T, n, R] and the per-branch d q_rope [B, n, T, G H, Dr] (to be summed over n). lse2: the
    log2-domain logsumexp, less log2(scale) under tuning.prescale."""
    heads, b, t, n, r = ql.shape
    dr, dtype = kr.shape[-1], lat.dtype
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    q_tiles = t // (COMPUTE_WGS * TILE)
    size = jnp.dtype(dtype).itemsize
    stages = _stages(COMPUTE_WGS * TILE * ((2 * r + dr) * size + 8), TILE * (r + dr) * size, tuning.dq_stages)
    scale_log2, transforms = scale * LOG2E, _transforms(dtype)
    shape = (TILE, TILE)

    def kernel(ql_ref, qr_ref, lat_ref, kr_ref, do_ref, lse_ref, delta_ref, dql_ref, dqr_ref, scoped):
        (ql_smem, qr_smem, do_smem, lse_smem, delta_smem, lat_smem, kr_smem), barriers = scoped
        q_barriers, kv_barriers, consumed = barriers
        bi, wg, j, hi, block, q_tile, max_steps = _dq_cta(heads, groups, q_tiles)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q0 = q_tile * (COMPUTE_WGS * TILE) + wg * TILE
            rows = pl.ds(q0, TILE)
            for c in range(lat_chunks):
                columns = pl.ds(c * CHUNK, CHUNK)
                plgpu.copy_gmem_to_smem(ql_ref.at[hi, bi, rows, j, columns], ql_smem.at[wg, c], q_barriers.at[wg])
                plgpu.copy_gmem_to_smem(do_ref.at[hi, bi, rows, j, columns], do_smem.at[wg, c], q_barriers.at[wg])
            for c in range(rope_chunks):
                plgpu.copy_gmem_to_smem(
                    qr_ref.at[bi, rows, hi, pl.ds(c * CHUNK, CHUNK)], qr_smem.at[wg, c], q_barriers.at[wg]
                )
            plgpu.copy_gmem_to_smem(lse_ref.at[bi, j, hi, rows], lse_smem.at[wg], q_barriers.at[wg])
            plgpu.copy_gmem_to_smem(delta_ref.at[bi, j, hi, rows], delta_smem.at[wg], q_barriers.at[wg])
            plgpu.barrier_wait(q_barriers.at[wg])
            lse, d = _vector(lse_smem.at[wg], 1, interpret), _vector(delta_smem.at[wg], 1, interpret)
            steps = q0 // TILE + 1  # key tiles these rows read: the last on the diagonal

            def scores(slot):  # S = [q_latent || q_rope] [latent || k_rope]^T, dP = dO latent^T
                return (
                    [(0, ql_smem.at[wg, c], lat_smem.at[slot, c], True) for c in range(lat_chunks)]
                    + [(0, qr_smem.at[wg, c], kr_smem.at[slot, c], True) for c in range(rope_chunks)]
                    + [(1, do_smem.at[wg, c], lat_smem.at[slot, c], True) for c in range(lat_chunks)]
                )

            def grads(slot, ds16):  # dS latent onto d q_latent, dS k_rope onto d q_rope
                return [(c, ds16, lat_smem.at[slot, c], False) for c in range(lat_chunks)] + [
                    (lat_chunks + c, ds16, kr_smem.at[slot, c], False) for c in range(rope_chunks)
                ]

            def gradient(s, dp, i, masked):
                """dS of one key tile from S and dP, in the inputs' dtype (prescale: lse is less log2(scale), so
                that exp2 gives scale P)."""
                if masked:
                    keep = _iota(shape, 0, interpret) + q0 >= _iota(shape, 1, interpret) + i * TILE
                    s = jnp.where(keep, s, -jnp.inf)
                p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(lse, shape, [0]))
                d_rows = lax.broadcast_in_dim(d, shape, [0])
                return (p * (dp - d_rows) if tuning.prescale else (p * scale) * (dp - d_rows)).astype(dtype)

            def release(i):
                pl.when(i + stages < max_steps)(
                    lambda: plgpu.barrier_arrive(consumed.at[lax.rem(i, jnp.int32(stages))])
                )

            def step(i, carry, masked):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(kv_barriers.at[slot])
                s, dp = _mma((_zeros(shape, interpret),) * 2, lambda: scores(slot), interpret)
                ds16 = _Reg(gradient(s, dp, i, masked))
                carry = _mma(carry, lambda: grads(slot, ds16), interpret)
                release(i)
                return carry

            accs = (_zeros((TILE, CHUNK), interpret),) * (lat_chunks + rope_chunks)
            accs = lax.fori_loop(0, steps - 1, functools.partial(step, masked=False), accs)
            accs = step(steps - 1, accs, masked=True)
            _skip_past_diagonal(kv_barriers, consumed, stages, steps, max_steps)
            _write_dq(accs, ql_smem.at[wg], qr_smem.at[wg], dql_ref, dqr_ref, (hi, bi, rows, j), dtype)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(i, slot):
                _fetch_keys(lat_ref, kr_ref, lat_smem.at[slot], kr_smem.at[slot], kv_barriers.at[slot], bi, i, block)

            stream_tiles(fetch, consumed, stages, min(stages, t // TILE), max_steps)  # (statically in bounds)

    def entry(*refs):
        smem = (
            plgpu.SMEM((COMPUTE_WGS, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, rope_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, TILE), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, TILE), jnp.float32),
            plgpu.SMEM((stages, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, rope_chunks, TILE, CHUNK), dtype, transforms=transforms),
        )
        barriers = (
            plgpu.Barrier(num_arrivals=2 * lat_chunks + rope_chunks + 2, num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=lat_chunks + rope_chunks, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    return _dq_launch(entry, ql.shape, dr, dtype, interpret)(ql, qr, lat, kr, do, lse2, delta)


def _dq_stored(ds_t, lat, kr, heads: int, *, groups: int, tuning: BackwardTuning, interpret: bool):
    """d q_latent [G H, B, T, n, R] and the per-branch d q_rope [B, n, T, G H, Dr] from the dK/dV kernel's dS^T tiles
    (tuning.stored_ds): a CTA takes one (latent block, query head, 128 queries, sequence) as _dq does, and per key
    tile up to the diagonal adds dS [latent || k_rope] (dS the stored tile, read transposed)."""
    b, t, blocks, r = lat.shape
    n, h = blocks // groups, heads // groups
    dr, dtype = kr.shape[-1], lat.dtype
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    q_tiles = t // (COMPUTE_WGS * TILE)
    size = jnp.dtype(dtype).itemsize
    resident = COMPUTE_WGS * TILE * (r + dr) * size  # the outputs on their way out
    stages = _stages(resident, TILE * (r + dr) * size + COMPUTE_WGS * TILE * TILE * size, tuning.dq_stages)
    transforms = _transforms(dtype)

    def kernel(ds_ref, lat_ref, kr_ref, dql_ref, dqr_ref, scoped):
        (out_lat_smem, out_rope_smem, ds_smem, lat_smem, kr_smem), (kv_barriers, consumed) = scoped
        bi, wg, j, hi, block, q_tile, max_steps = _dq_cta(heads, groups, q_tiles)
        within = lax.rem(hi, h)  # the head's place among its block's

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q0 = q_tile * (COMPUTE_WGS * TILE) + wg * TILE
            steps = q0 // TILE + 1  # key tiles these rows read: the last on the diagonal

            def grads(slot):  # dS latent onto d q_latent, dS k_rope onto d q_rope
                ds = _Transposed(ds_smem.at[slot, wg])
                return [(c, ds, lat_smem.at[slot, c], False) for c in range(lat_chunks)] + [
                    (lat_chunks + c, ds, kr_smem.at[slot, c], False) for c in range(rope_chunks)
                ]

            def step(i, carry):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(kv_barriers.at[slot])
                carry = _mma(carry, lambda: grads(slot), interpret)
                pl.when(i + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[slot]))
                return carry

            accs = lax.fori_loop(0, steps, step, (_zeros((TILE, CHUNK), interpret),) * (lat_chunks + rope_chunks))
            _skip_past_diagonal(kv_barriers, consumed, stages, steps, max_steps)
            at = (hi, bi, pl.ds(q0, TILE), j)
            _write_dq(accs, out_lat_smem.at[wg], out_rope_smem.at[wg], dql_ref, dqr_ref, at, dtype)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(i, slot):
                _fetch_keys(lat_ref, kr_ref, lat_smem.at[slot], kr_smem.at[slot], kv_barriers.at[slot], bi, i, block)
                last = q_tile * COMPUTE_WGS + COMPUTE_WGS - 1  # the second warpgroup's query tile
                for w in range(COMPUTE_WGS):  # (the first's tile past its diagonal: the second's, unread)
                    qt = jnp.where(i <= last - (COMPUTE_WGS - 1 - w), last - (COMPUTE_WGS - 1 - w), last)
                    plgpu.copy_gmem_to_smem(
                        ds_ref.at[bi, block, within, packed(qt, i)], ds_smem.at[slot, w], kv_barriers.at[slot]
                    )

            stream_tiles(fetch, consumed, stages, min(stages, t // TILE), max_steps)  # (statically in bounds)

    def entry(*refs):
        smem = (
            plgpu.SMEM((COMPUTE_WGS, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, rope_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, COMPUTE_WGS, TILE, TILE), dtype, transforms=transforms),
            plgpu.SMEM((stages, lat_chunks, TILE, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, rope_chunks, TILE, CHUNK), dtype, transforms=transforms),
        )
        barriers = (
            plgpu.Barrier(num_arrivals=lat_chunks + rope_chunks + COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    return _dq_launch(entry, (heads, b, t, n, r), dr, dtype, interpret)(ds_t, lat, kr)


def check_backward_shapes(
    q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, interpret: bool, groups: int = 1
):
    """The backward's constraints, as ValueErrors naming the value and the limit."""
    heads, b, t, n, r = q_latent.shape
    s, dr = k_rope.shape[1], k_rope.shape[2]
    if groups < 1 or heads % groups:
        raise ValueError(f"groups={groups} must divide the {heads} query heads")
    if q_rope.shape != (b, t, heads, dr) or latent.shape != (b, s, n * groups, r) or k_rope.shape != (b, s, dr):
        raise ValueError(
            f"shapes do not match: q_latent {q_latent.shape}, q_rope {q_rope.shape}, latent {latent.shape}, "
            f"k_rope {k_rope.shape}"
        )
    allowed = (jnp.bfloat16, jnp.float16, jnp.float32) if interpret else (jnp.bfloat16, jnp.float16)
    if latent.dtype not in allowed or len({q_latent.dtype, q_rope.dtype, latent.dtype, k_rope.dtype}) != 1:
        raise ValueError(f"the MLRA attention backward takes one dtype of {', '.join(map(str, allowed))}")
    if t != s or t % (COMPUTE_WGS * TILE) or r % CHUNK or dr % CHUNK:
        raise ValueError(
            f"the backward takes causal self-attention (T == S) over a multiple of {COMPUTE_WGS * TILE} tokens, "
            f"latent and RoPE widths that are multiples of {CHUNK}; got T={t}, S={s}, R={r}, Dr={dr}"
        )
    if r + dr > BACKWARD_COLUMNS:
        raise ValueError(
            f"the backward's accumulators take R + Dr <= {BACKWARD_COLUMNS} columns per warpgroup; got R={r}, Dr={dr}"
        )


@functools.partial(jax.jit, static_argnames=("scale", "groups", "tuning", "interpret"))
def mlra_attention_backward(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    scale: float,
    groups: int = 1,
    tuning: BackwardTuning = BackwardTuning(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The gradients (d q_latent, d q_rope, d latent, d k_rope) of the causal MLRA attention (mlra_attention_gpu's
    inputs and `groups`, its output `out` and logsumexp `lse` [B, n, G H, T]) for the output's cotangent d_out
    [G H, B, T, n, R]. tuning: the kernels' schedules (BackwardTuning; the defaults: the fastest measured).
    Constraints (ValueError outside them): T == S a multiple of 128, R and Dr multiples of 64, R + Dr <= 192."""
    check_backward_shapes(q_latent, q_rope, latent, k_rope, interpret, groups)
    tuning.check()
    f32 = jnp.float32
    d_out = d_out.astype(latent.dtype)
    delta = jnp.einsum("hbtnr,hbtnr->bnht", out.astype(f32), d_out.astype(f32))
    lse2 = lse.astype(f32) * LOG2E
    args = (q_latent, q_rope, latent, k_rope, d_out)
    if tuning.prescale:  # dK/dV: scale D; dQ: exp2 gives scale P
        dkv_extra, dq_extra = (lse2, delta * scale), (lse2 - math.log2(scale), delta)
    else:
        dkv_extra = dq_extra = (lse2, delta)
    options = dict(scale=scale, groups=groups, tuning=tuning, interpret=interpret)
    d_latent, d_k_rope, *ds_t = _dkv(*args, *dkv_extra, **options)  # ds_t: [dS^T tiles] under stored_ds
    if tuning.stored_ds:
        stored = dict(groups=groups, tuning=tuning, interpret=interpret)
        d_q_latent, d_q_rope = _dq_stored(*ds_t, latent, k_rope, q_latent.shape[0], **stored)
    else:
        d_q_latent, d_q_rope = _dq(*args, *dq_extra, **options)
    d_q_rope = d_q_rope.astype(f32).sum(axis=1).astype(q_rope.dtype)
    d_k_rope = d_k_rope.astype(f32).sum(axis=1).astype(k_rope.dtype)
    # The sums as arrays of their own: fused into the RoPE backward's loop fusion, each sum was recomputed once per
    # use (on an H200 that fusion took 4.3 ms of MLRA-4's 8-layer step at batch 12, and 2.8 ms after; the step's
    # kernels 402.0 -> 400.4 ms)
    d_q_rope, d_k_rope = lax.optimization_barrier((d_q_rope, d_k_rope))
    return d_q_latent, d_q_rope, d_latent, d_k_rope


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _attention(scale, groups, block_kv, tuning, interpret, q_latent, q_rope, latent, k_rope):
    return _attention_fwd(scale, groups, block_kv, tuning, interpret, q_latent, q_rope, latent, k_rope)[0]


def _attention_fwd(scale, groups, block_kv, tuning, interpret, q_latent, q_rope, latent, k_rope):
    check_backward_shapes(q_latent, q_rope, latent, k_rope, interpret, groups)
    kernel_outputs = mlra_attention_gpu(
        q_latent, q_rope, latent, k_rope, scale=scale, groups=groups, block_kv=block_kv, interpret=interpret
    )
    out, lse = (checkpoint_name(x, name) for x, name in zip(kernel_outputs, MLRA_ATTENTION_RESIDUALS))
    return out, (q_latent, q_rope, latent, k_rope, out, lse)


def _attention_bwd(scale, groups, block_kv, tuning, interpret, residuals, d_out):
    return mlra_attention_backward(*residuals, d_out, scale=scale, groups=groups, tuning=tuning, interpret=interpret)


_attention.defvjp(_attention_fwd, _attention_bwd)


def mlra_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    *,
    scale: float,
    groups: int = 1,
    block_kv: int = BLOCK_KV,
    tuning: BackwardTuning | str = BackwardTuning(),
    interpret: bool = False,
) -> jax.Array:
    """Causal MLRA attention out [G H, B, T, n, R] (mlra_attention_gpu's forward with its defaults; `groups` G as
    there) with its gradients by mlra_attention_backward's kernels: jax.grad and jax.vjp run through both. tuning:
    the backward's schedules (a BackwardTuning or its BackwardTuning.parse spelling). The forward's out and lse carry
    the names MLRA_ATTENTION_RESIDUALS, which the dots_attn remat policies keep: Mosaic GPU's kernel call is opaque
    to the policies, which would otherwise run the forward again in the backward."""
    if isinstance(tuning, str):
        tuning = BackwardTuning.parse(tuning)
    return _attention(scale, groups, block_kv, tuning, interpret, q_latent, q_rope, latent, k_rope)
