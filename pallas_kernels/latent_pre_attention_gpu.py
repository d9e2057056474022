"""The latent family's batch-1 work before the attention as one Pallas Triton kernel (GPUs): the norms, the
projections, RoPE and the cache write of one token, which latent_rows_gpu and row_products_gpu do in three.

At batch 1 those three kernels (x_proj with the attention norm, q_up with the query norm, latent_queries with
the cache entry) are a chain whose every link pays a launch and the first loads' latency, 2-3 us each on an
H100, more than their weights take at the copy rate. Here one persistent kernel of one program per SM runs
them as three phases separated by grid barriers (an atomic counter each, as CUTLASS's generic barrier):

  A. x_proj: the attention norm of the residual row and x's three projections (c_q | latent blocks | RoPE key);
  B. the token's cache entry (n programs, as latent_queries writes it) and q_up: the query norm of c_q and
     every head's q_nope || q_rope;
  C. latent_queries: W_UK absorbed into every block's queries and the heads' q_rope rotated.

Every program issues the loads of its next phases' weights before it waits at a barrier (as many as
LOADS_AHEAD_BYTES of registers hold), so the memory keeps streaming weights while the grid synchronizes:
the weights depend on nothing the earlier phases write. The programs must all be resident at once: there is
one per SM and each fits on one. A barrier gives up after MAX_POLLS polls rather than wait forever (the results
are then wrong, which the GPU test would show), and the last program out sets the counters back to zero, so
the same counters serve the next call. In interpret mode (CPU, the tests) the programs run one after another,
so the phases are a leading grid axis instead of barriers.

Every phase rounds as the kernels it replaces (norm_matvec, latent_queries and their references); the result
equals theirs up to the float32 summation order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from mlra_jax.pallas_kernels.latent_rows_gpu import QUERY_RANKS, LatentEntry, _rotated, _write_entry
from mlra_jax.pallas_kernels.row_products_gpu import _normed, _unrolled_tiles

F32 = jnp.float32
ROWS = 16  # weight rows per tile of phases A and B (a power of two that divides both products' outputs)
BLOCK_K = 2048  # the widest K piece of a tile, as norm_matvec's unrolled tiling reads it
NUM_WARPS = 8
LOADS_AHEAD_BYTES = 128 * 1024  # weight bytes a program holds in registers at once (128 registers a thread)
MAX_POLLS = 1 << 24  # a barrier's polls of its counter before it gives up (seconds on an H100)
COUNTERS = 3  # arrivals at the two barriers, and the programs done


@dataclasses.dataclass(frozen=True)
class PreAttentionNorms:
    """The three norms' scales and constants: the attention norm's (float32 [d]) on the residual row, the query
    norm's ([d_c']) and the latent norm's ([n, R]) with the query and latent scales."""

    attn_scale: jax.Array
    attn_eps: float
    q_scale: jax.Array
    q_eps: float
    q_extra: float
    kv_scale: jax.Array
    kv_eps: float
    latent_scale: float


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static work of each program: tiles of phases A and B, items of phase C, and when each is loaded."""

    programs: int
    a_tiles: int  # x_proj row tiles (ROWS rows)
    b_tiles: int  # q_up row tiles
    c_items: int  # latent_queries items: (block, head, QUERY_RANKS ranks)
    a_bytes: int  # bytes of one tile (or item)
    b_bytes: int
    c_bytes: int

    def per_program(self, tiles: int) -> int:
        return -(-tiles // self.programs)

    def schedule(self) -> tuple[int, int, int, int]:
        """(B tiles loaded with A's, B tiles and C items loaded after A before the first barrier, and C items
        loaded before the second barrier): each in the order the program reads them, within LOADS_AHEAD_BYTES."""
        a, b, c = (self.per_program(t) for t in (self.a_tiles, self.b_tiles, self.c_items))
        b_first = min(b, max(0, (LOADS_AHEAD_BYTES - a * self.a_bytes) // self.b_bytes))
        b_second = min(b - b_first, max(0, LOADS_AHEAD_BYTES // self.b_bytes - b_first))
        held = (b_first + b_second) * self.b_bytes
        c_first = min(c, max(0, (LOADS_AHEAD_BYTES - held) // self.c_bytes))
        return b_first, b_second, c_first, c


def check_pre_attention_shapes(x_rows: int, q_rows: int) -> None:
    """A ValueError unless the kernel takes x_proj's and q_up's outputs: whole tiles of ROWS rows."""
    for name, rows in (("x_proj", x_rows), ("q_up", q_rows)):
        if rows % ROWS:
            raise ValueError(f"latent_pre_attention needs {name}'s {rows} outputs in multiples of {ROWS}")


def default_programs() -> int:
    """One program per SM of the default device (132 on an H100 SXM)."""
    from mlra_jax.pallas_kernels.latent_decode_gpu import sm_count

    return sm_count()


def latent_pre_attention(
    x: jax.Array,
    x_proj: jax.Array,
    q_up: jax.Array,
    kv_up: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    norms: PreAttentionNorms,
    caches: tuple[jax.Array, jax.Array],
    slot: jax.Array,
    counters: jax.Array,
    *,
    branches: int,
    programs: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """One token's queries and cache entry from its residual row x [d] (float32).

    x_proj [d_c' + n R + d_h^R, d] (out-major: c_q, the latent blocks, the RoPE key), q_up [h (d_h + d_h^R),
    d_c'] (each head's q_nope then q_rope), kv_up [2, n, H_b, R, d_h] (W_UK, W_UV, head-major), cos and sin of
    the token's position [d_h^R / 2], caches (latent [1, S, n, R], k_rope [1, S, 1, d_h^R], written at `slot`
    [1] in place) and counters (int32 [COUNTERS], zeros; returned as zeros). Returns q_latent [n, H_b, R],
    q_rope [n, H_b, d_h^R] (as latent_queries), the two caches and the counters."""
    (d,) = x.shape
    _, n, heads, r, dh = kv_up.shape
    nx, d_w = x_proj.shape
    nq, dq = q_up.shape
    dr = nx - dq - n * r
    width, groups, ranks = dh + dr, n // branches, min(r, QUERY_RANKS)
    check_pre_attention_shapes(nx, nq)
    if d_w != d or nq != groups * heads * width or dr < 2 or r % ranks:
        raise ValueError(
            f"latent_pre_attention: x {x.shape}, x_proj {x_proj.shape}, q_up {q_up.shape} and kv_up {kv_up.shape} "
            f"with {branches} branches do not fit together"
        )
    if counters.shape != (COUNTERS,) or counters.dtype != jnp.int32:
        raise ValueError(f"latent_pre_attention: counters must be int32 [{COUNTERS}] zeros; got {counters}")
    dtype, parts = x_proj.dtype, r // ranks
    p_count = programs or (4 if interpret else default_programs())
    plan = _Plan(
        p_count,
        nx // ROWS,
        nq // ROWS,
        n * heads * parts,
        ROWS * d * dtype.itemsize,
        ROWS * dq * dtype.itemsize,
        ranks * dh * dtype.itemsize,
    )
    a_k, b_k = (_unrolled_tiles(k, min(BLOCK_K, 1 << (k.bit_length() - 1))) for k in (d, dq))
    projected = jax.ShapeDtypeStruct((nx,), dtype)  # x_proj's output: the entry's row (only its dtype is read)
    entry = LatentEntry(projected, norms.kv_scale, offset=dq, eps=norms.kv_eps, latent_scale=norms.latent_scale)
    half = dr // 2

    def kernel(x_ref, attn_ref, w_x_ref, q_norm_ref, w_q_ref, kv_ref, cos_ref, sin_ref, kv_norm_ref, slot_ref, *refs):
        _latent_in, _k_rope_in, _counters_in, q_latent_ref, q_rope_ref, latent_ref, k_rope_ref, count_ref = refs[:8]
        projected_ref, q_ref = refs[8:]

        def read(ref, idx, shape=None, valid=None):
            """ref[idx]; on GPUs, with `valid`, a masked load (no memory read where False). Interpret mode reads
            every tile whole (the indices are clamped)."""
            if interpret or valid is None:
                return ref[idx]
            return pltriton.load(ref.at[idx], mask=jnp.full(shape, valid), other=jnp.zeros((), ref.dtype))

        def tiles_of(p, count, first, total):
            """The program's tiles `first` .. `first + count - 1` of `total`: (tile, valid) each."""
            out = []
            for i in range(first, first + count):
                tile = p + i * plan.programs
                out.append((jnp.minimum(tile, total - 1), tile < total))
            return out

        def load_rows(w_ref, k_pieces, tile, valid):
            rows = pl.ds(pl.multiple_of(tile * ROWS, ROWS), ROWS)
            return [read(w_ref, (rows, pl.ds(k0, size)), (ROWS, size), valid) for k0, size in k_pieces]

        def load_a(p):
            return [
                (t, v, load_rows(w_x_ref, a_k, t, v))
                for t, v in tiles_of(p, plan.per_program(plan.a_tiles), 0, plan.a_tiles)
            ]

        def load_b(p, count, first):
            return [(t, v, load_rows(w_q_ref, b_k, t, v)) for t, v in tiles_of(p, count, first, plan.b_tiles)]

        def item(u):
            block = u // (heads * parts)
            return block, lax.rem(u // parts, heads), lax.rem(u, parts)

        def load_c(p, count, first):
            loaded = []
            for u, valid in tiles_of(p, count, first, plan.c_items):
                block, head, part = item(u)
                ranks_at = pl.ds(pl.multiple_of(part * ranks, ranks), ranks)
                w = read(kv_ref, (0, block, head, ranks_at, slice(None)), (ranks, dh), valid)
                loaded.append((u, valid, w))
            return loaded

        def normed_row(row_ref, scale_ref, k_pieces, k, eps, extra, row_dtype):
            """norm_matvec's unrolled prologue: the row's tiles, normalized, in float32 of the compute dtype."""
            loaded = {k0: (read(row_ref, pl.ds(k0, size)), scale_ref[pl.ds(k0, size)]) for k0, size in k_pieces}
            inverse = lax.rsqrt(sum(jnp.sum(jnp.square(v.astype(F32))) for v, _ in loaded.values()) / k + eps)
            return {k0: _normed(v, inverse, s, extra, row_dtype, dtype) for k0, (v, s) in loaded.items()}

        def products(out_ref, loaded, row, k_pieces):
            for tile, valid, pieces in loaded:
                sums = jnp.zeros((ROWS,), F32)
                for (k0, _), w in zip(k_pieces, pieces):
                    sums = sums + jnp.sum(w.astype(F32) * row[k0][None, :], axis=1)

                @pl.when(valid)
                def _store():
                    out_ref[pl.ds(pl.multiple_of(tile * ROWS, ROWS), ROWS)] = sums.astype(out_ref.dtype)

        def phase_a(loaded):
            row = normed_row(x_ref, attn_ref, a_k, d, norms.attn_eps, 1.0, x.dtype)
            products(projected_ref, loaded, row, a_k)

        def phase_b(p, loaded):
            for block, valid in tiles_of(p, plan.per_program(n), 0, n):  # the entry's blocks

                @pl.when(valid)
                def _entry():
                    refs = (projected_ref, kv_norm_ref, latent_ref, k_rope_ref)
                    _write_entry(entry, refs, block, slot_ref[0], cos_ref[...], sin_ref[...])

            row = normed_row(projected_ref, q_norm_ref, b_k, dq, norms.q_eps, norms.q_extra, dtype)
            products(q_ref, loaded, row, b_k)

        def phase_c(loaded):
            for u, valid, w in loaded:
                block, head, part = item(u)
                start = pl.multiple_of((lax.rem(block, groups) * heads + head) * width, math.gcd(width, 64))
                q_nope = read(q_ref, pl.ds(start, dh)).astype(F32)

                @pl.when(valid)
                def _store():
                    latent = jnp.sum(w.astype(F32) * q_nope[None, :], axis=1)
                    q_latent_ref[block, head, pl.ds(pl.multiple_of(part * ranks, ranks), ranks)] = latent.astype(
                        q_latent_ref.dtype
                    )

                @pl.when(valid & (part == 0))
                def _rope():
                    x1 = read(q_ref, pl.ds(start + dh, half)).astype(F32)
                    x2 = read(q_ref, pl.ds(start + dh + half, half)).astype(F32)
                    y1, y2 = _rotated(x1, x2, cos_ref[...], sin_ref[...])
                    q_rope_ref[block, head, pl.ds(0, half)] = y1.astype(q_rope_ref.dtype)
                    q_rope_ref[block, head, pl.ds(half, half)] = y2.astype(q_rope_ref.dtype)

        if interpret:  # one program at a time: the phases are the grid's leading axis
            phase, p = pl.program_id(0), pl.program_id(1)
            pl.when(phase == 0)(lambda: phase_a(load_a(p)))
            pl.when(phase == 1)(lambda: phase_b(p, load_b(p, plan.per_program(plan.b_tiles), 0)))
            pl.when(phase == 2)(lambda: phase_c(load_c(p, plan.per_program(plan.c_items), 0)))
            return

        p = pl.program_id(0)
        b_first, b_second, c_first, c_all = plan.schedule()
        b_total = plan.per_program(plan.b_tiles)
        a_loaded, b_loaded = load_a(p), load_b(p, b_first, 0)  # issued before the norm's loads
        phase_a(a_loaded)
        b_loaded += load_b(p, b_second, b_first)
        c_loaded = load_c(p, c_first, 0)
        _grid_barrier(count_ref, 0, plan.programs)
        b_loaded += load_b(p, b_total - b_first - b_second, b_first + b_second)
        phase_b(p, b_loaded)
        c_loaded += load_c(p, c_all - c_first, c_first)
        _grid_barrier(count_ref, 1, plan.programs)
        phase_c(c_loaded)
        _leave(count_ref, plan.programs)

    operands = [
        x,
        norms.attn_scale,
        x_proj,
        norms.q_scale,
        q_up,
        kv_up,
        cos,
        sin,
        norms.kv_scale,
        slot.astype(jnp.int32),
        *caches,
        counters,
    ]
    out_shape = [
        jax.ShapeDtypeStruct((n, heads, r), dtype),
        jax.ShapeDtypeStruct((n, heads, dr), dtype),
        *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches),
        jax.ShapeDtypeStruct(counters.shape, counters.dtype),
        projected,  # x_proj's output, read by the later phases
        jax.ShapeDtypeStruct((nq,), dtype),  # q_up's
    ]
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(3, p_count) if interpret else (p_count,),
        in_specs=[whole(a.shape) for a in operands],
        out_specs=tuple(whole(o.shape) for o in out_shape),
        input_output_aliases={len(operands) - 3: 2, len(operands) - 2: 3, len(operands) - 1: 4},
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="latent_pre_attention",
    )(*operands)
    return outs[:5]


def _grid_barrier(count_ref, index: int, programs: int) -> None:
    """Every program's stores before it, visible to every program after it: each program's threads synchronize,
    one of them adds 1 to counter `index` (release) and polls it (acquire) until all `programs` arrived."""
    pltriton.debug_barrier()
    pltriton.atomic_add(count_ref, index, 1)

    def waiting(state):
        count, polls = state
        return (count < programs) & (polls < MAX_POLLS)

    def poll(state):
        _, polls = state
        return pltriton.atomic_add(count_ref, index, 0), polls + 1

    lax.while_loop(waiting, poll, (jnp.int32(0), jnp.int32(0)))


def _leave(count_ref, programs: int) -> None:
    """The last program out (every other one past both barriers) sets the counters back to zero."""
    done = pltriton.atomic_add(count_ref, COUNTERS - 1, 1)

    @pl.when(done == programs - 1)
    def _reset():
        for index in range(COUNTERS):
            pltriton.atomic_xchg(count_ref, index, 0)


def latent_pre_attention_reference(
    x, x_proj, q_up, kv_up, cos, sin, norms: PreAttentionNorms, caches, slot, *, branches
) -> tuple[jax.Array, ...]:
    """The three kernels' references in a row: norm_matvec (x_proj), norm_matvec (q_up), latent_queries and
    write_latent_entry."""
    from mlra_jax.pallas_kernels.latent_rows_gpu import latent_queries_reference, write_latent_entry_reference
    from mlra_jax.pallas_kernels.row_products_gpu import norm_matvec_reference

    dq = q_up.shape[1]
    projected = norm_matvec_reference(x, x_proj, norms.attn_scale, eps=norms.attn_eps)
    q = norm_matvec_reference(projected, q_up, norms.q_scale, eps=norms.q_eps, extra=norms.q_extra)
    heads = q_up.shape[0] // (kv_up.shape[-1] + 2 * cos.shape[0])
    q_latent, q_rope = latent_queries_reference(q.reshape(heads, -1), kv_up, cos, sin, branches=branches)
    entry = LatentEntry(projected, norms.kv_scale, offset=dq, eps=norms.kv_eps, latent_scale=norms.latent_scale)
    return (q_latent, q_rope, *write_latent_entry_reference(entry, cos, sin, *caches, slot))
