"""Products of one row with a weight matrix for batch-1 decode steps, as Pallas Triton kernels (GPUs), with the
elementwise work around each product done inside it.

At batch 1 a decode step is a chain of matrix-vector products with small elementwise kernels between them
(norms, residual adds, the SwiGLU); on an H100 each of those costs 1.1-1.6 us whatever its bytes, about a sixth
of a 2.9B layer's time. Here the norm is the product's prologue and the SwiGLU or the residual add its
epilogue, with the model's roundings:

* norm_matvec:        W bf16(RMSNorm(x) * extra), every program normalizing the row itself (it is small);
* swiglu_norm_matvec: silu(W_gate a) * (W_up a) for a = bf16(RMSNorm(x)), as the SwiGLU rounds it;
* matvec_add:         residual + W h, the product rounded to the compute dtype first.

Weights are stored [N, K] (outputs, inputs): each program reduces `block_rows` rows of W along their
contiguous K axis in [block_rows, block_k] tiles, so every load is a coalesced row segment. Each function
has a jnp reference (`*_reference`) with the same roundings, which the tests check the kernels against in
interpret mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from mlra_jax.pallas_kernels.block_specs import whole_block

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a program computes its rows of W x.

    engine "fma": elementwise multiply-adds over [block_rows, block_k] tiles, the loads of the next `prefetch`
    tiles issued before this one is reduced (Triton pipelines no loads that feed no dot), or with `unroll` all
    of a program's tiles loaded at once, and the row's tiles (and its norm's statistics) from one load each.
    engine "dot": tensor-core products of 16 rows (the row, then zeros) with [block_rows, block_k] tiles, whose
    loads Triton pipelines `num_stages` deep; block_rows is the product's N (at least 16).
    Each program takes block_rows rows of W; every program computes the row's prologue (its norm) itself."""

    engine: str = "fma"
    block_rows: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    prefetch: int = 1  # fma: K tiles loaded ahead of the one being reduced
    unroll: bool = False  # fma: no loop; every tile of the program's rows loaded at once (small K x block_rows)

    def __post_init__(self) -> None:
        if self.engine not in ("fma", "dot") or min(self.block_rows, self.block_k, self.num_warps, self.prefetch) < 1:
            raise ValueError(f"a tiling takes engine 'fma' or 'dot' and positive sizes; got {self}")

    def fitted(self, n: int, k: int) -> Tiling:
        """This tiling with block_rows shrunk to a power of two that divides N, and block_k to at most K."""
        return dataclasses.replace(
            self,
            block_rows=_largest_dividing_power(n, self.block_rows),
            block_k=min(self.block_k, 1 << (k.bit_length() - 1)),
        )

    def params(self) -> pltriton.CompilerParams:
        return pltriton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


# Measured in the 2.9B models' decode step on an H100 (python -m mlra_jax.benchmarks.decode model, batch 1,
# context 8K; MLA's us per layer, 2026-11-25): every product unrolled, each program issuing all its loads at once
# and reading the row (and its norm's statistics) once, where a loop took the statistics in a pass of loads of its
# own and loaded each step's row and scale tiles again: the SwiGLU on one-row programs (43.0 -> 41.7 us; alone
# 2 rows were faster, in the step slower), the down projection on one-row programs of 8 warps (22.6 -> 22.3),
# the attention's products and the head on 4-row programs (o_proj 9.55 -> 8.6, q_up 7.9 -> 7.5, x_proj 7.4 ->
# 7.1, head 106 -> 103 per token).
# Rows longer than these fall back to loops, which keep no whole row in registers.
UNROLLED_K = 4096  # the longest row an unrolled program of 4 warps reads whole
SWIGLU_TILING = Tiling("fma", block_rows=1, block_k=2048, num_warps=4, unroll=True)


def default_tiling(k: int) -> Tiling:
    """The tiling of norm_matvec and matvec_add for a product over K inputs."""
    if k <= UNROLLED_K:
        return Tiling("fma", block_rows=4, block_k=2048, num_warps=4, unroll=True)
    if k <= 4 * UNROLLED_K:
        return Tiling("fma", block_rows=1, block_k=8192, num_warps=8, unroll=True)
    return Tiling("fma", block_rows=4, block_k=512, num_warps=4)


def swiglu_tiling(k: int) -> Tiling:
    """The tiling of swiglu_norm_matvec over K inputs."""
    return SWIGLU_TILING if k <= UNROLLED_K else Tiling("fma", block_rows=1, block_k=512, num_warps=4)


def _largest_dividing_power(n: int, at_most: int) -> int:
    power = 1
    while power * 2 <= at_most and n % (power * 2) == 0:
        power *= 2
    return power


def _unrolled_tiles(k: int, block_k: int) -> list[tuple[int, int]]:
    """The (offset, size) tiles of an unrolled program over K: the whole tiles, then the tail's."""
    steps, tail = _k_tiles(k, block_k)
    return [(i * block_k, block_k) for i in range(steps)] + tail


def _k_tiles(k: int, block_k: int) -> tuple[int, list[tuple[int, int]]]:
    """K as `steps` whole tiles of block_k and a tail of smaller power-of-two tiles (offset, size), at least 16 wide."""
    if k % 16:
        raise ValueError(f"the row-product kernels take K in multiples of 16; got {k}")
    steps, offset, tail = k // block_k, (k // block_k) * block_k, []
    size = block_k
    while offset < k:
        size //= 2
        if k - offset >= size:
            tail.append((offset, size))
            offset += size
    return steps, tail


# A row product's two ends: start(refs) -> what every step needs (the norm's inverse, or None);
# row_tile(refs, started, k0, size) -> the row's values [size] at k0 as the product reads them (float32 of
# compute-dtype values); finish(refs, sums) -> the values stored for the program's rows from their float32 sums.
Start = Callable[[Sequence[Any]], Any]
RowTile = Callable[[Sequence[Any], Any, Any, int], jax.Array]
Finish = Callable[[Sequence[Any], list[jax.Array]], jax.Array]


def _row_product(
    operands: Sequence[jax.Array],
    specs: Sequence[Callable[[Tiling], pl.BlockSpec]],
    weight: int,
    start: Start,
    row_tile: RowTile,
    finish: Finish,
    out: jax.ShapeDtypeStruct,
    tiling: Tiling,
    name: str,
    interpret: bool,
) -> jax.Array:
    """One pallas_call over the rows of operands[weight], W [G, N, K] (G weights read with the same row): each
    program reduces block_rows rows of every W against the row (row_tile) and stores finish(...) at those rows
    of the output [N]."""
    g, n, k = operands[weight].shape
    t = tiling.fitted(n, k)
    rows = t.block_rows
    steps, tail = _k_tiles(k, t.block_k)
    if t.engine == "dot" and (rows < 16 or jnp.dtype(operands[weight].dtype).itemsize != 2):
        raise ValueError(
            f"the dot engine takes 16-bit weights (a float32 dot rounds them to TF32) and at least 16 "
            f"rows per block; got {operands[weight].dtype} and {rows} rows of N={n}"
        )

    def kernel(*refs):
        ins, out_ref = refs[:-1], refs[-1]
        w_ref = ins[weight]

        def w_tiles(k0, size):
            return [w_ref[i, :, pl.ds(k0, size)] for i in range(g)]

        def fma_sums():
            def k_tile(i):
                return w_tiles(pl.multiple_of(jnp.minimum(i, steps - 1) * t.block_k, t.block_k), t.block_k)

            def products(sums, started, tiles, k0, size):
                a = row_tile(ins, started, k0, size)[None, :]
                return [s + jnp.sum(w.astype(F32) * a, axis=1) for s, w in zip(sums, tiles)]

            sums = [jnp.zeros((rows,), F32)] * g
            if t.unroll:  # every tile's load issued first, before the prologue's
                whole = _unrolled_tiles(k, t.block_k)
                tiles = [w_tiles(k0, size) for k0, size in whole]
                started = start(ins)
                for (k0, size), tile in zip(whole, tiles):
                    sums = products(sums, started, tile, k0, size)
                return sums

            def step(i, carry):
                accs, ahead = carry  # the tiles of steps i .. i + prefetch - 1, loaded
                ahead = [*ahead[1:], k_tile(i + t.prefetch)], ahead[0]
                a = row_tile(ins, started, pl.multiple_of(i * t.block_k, t.block_k), t.block_k)[None, :]
                return [acc + w.astype(F32) * a for acc, w in zip(accs, ahead[1])], ahead[0]

            first = [k_tile(i) for i in range(t.prefetch)] if steps else []  # issued before the prologue's loads
            started = start(ins)
            if steps:
                zeros = [jnp.zeros((rows, t.block_k), F32)] * g
                accs, _ = lax.fori_loop(0, steps, step, (zeros, first))
                sums = [jnp.sum(acc, axis=1) for acc in accs]
            for k0, size in tail:
                sums = products(sums, started, w_tiles(k0, size), k0, size)
            return sums

        def dot_sums():
            started = start(ins)

            def products(accs, k0, size):
                a = row_tile(ins, started, k0, size)
                first = lax.broadcasted_iota(jnp.int32, (16, size), 0) == 0
                a16 = jnp.where(first, a[None, :], 0.0).astype(w_ref.dtype)  # the row, then zeros
                return [
                    acc + lax.dot_general(a16, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
                    for acc, w in zip(accs, w_tiles(k0, size))
                ]

            accs = [jnp.zeros((16, rows), F32)] * g
            if steps:
                accs = lax.fori_loop(
                    0, steps, lambda i, accs: products(accs, pl.multiple_of(i * t.block_k, t.block_k), t.block_k), accs
                )
            for k0, size in tail:
                accs = products(accs, k0, size)
            return [jnp.sum(acc, axis=0) for acc in accs]  # the zero rows add nothing

        out_ref[...] = finish(ins, (dot_sums if t.engine == "dot" else fma_sums)())

    return pl.pallas_call(
        kernel,
        out_shape=out,
        grid=(n // rows,),
        in_specs=[spec(t) for spec in specs],
        out_specs=pl.BlockSpec((rows,), lambda i: (i,)),
        compiler_params=t.params(),
        interpret=interpret,
        name=name,
    )(*operands)


def _whole(shape: tuple[int, ...]) -> Callable[[Tiling], pl.BlockSpec]:
    return lambda t: whole_block(shape)


def _weight_rows(g: int, k: int) -> Callable[[Tiling], pl.BlockSpec]:
    return lambda t: pl.BlockSpec((g, t.block_rows, k), lambda i: (0, i, 0))


def _program_rows(t: Tiling) -> pl.BlockSpec:
    return pl.BlockSpec((t.block_rows,), lambda i: (i,))


# -- the shared prologue --------------------------------------------------------------------------------------
def _rms_inverse(x_ref, offset: int, k: int, block_k: int, eps: float) -> jax.Array:
    """1 / sqrt(mean(x^2) + eps) of the row x_ref[offset: offset + k] in float32."""
    steps, tail = _k_tiles(k, block_k)

    def squares(k0, size):
        x = x_ref[pl.ds(offset + k0, size)].astype(F32)
        return x * x

    total = jnp.float32(0)
    if steps:
        total = jnp.sum(
            lax.fori_loop(
                0,
                steps,
                lambda i, acc: acc + squares(pl.multiple_of(i * block_k, block_k), block_k),
                jnp.zeros((block_k,), F32),
            )
        )
    for k0, size in tail:
        total = total + jnp.sum(squares(k0, size))
    return lax.rsqrt(total / k + eps)


def _normed(
    x: jax.Array,
    inverse: jax.Array | None,
    scale: jax.Array | None,
    extra: float,
    row_dtype: jnp.dtype,
    compute_dtype: jnp.dtype,
) -> jax.Array:
    """layers.rms_norm of x's tile (x32 * inverse rounded to the row's dtype, times the float32 scale), times
    `extra`, rounded to the compute dtype; without a norm, x rounded to the compute dtype. Returned in float32."""
    x = x.astype(F32)
    if inverse is not None:
        x = (x * inverse).astype(row_dtype).astype(F32) * scale
        if extra != 1.0:
            x = x * extra
    return x.astype(compute_dtype).astype(F32)


def _norm_reference(
    x: jax.Array, scale: jax.Array | None, eps: float, extra: float, compute_dtype: jnp.dtype
) -> jax.Array:
    """The prologue in jnp (layers.rms_norm, times `extra`, in the compute dtype)."""
    if scale is None:
        return x.astype(compute_dtype)
    x32 = x.astype(F32)
    normed = (x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype) * scale
    return (normed * extra if extra != 1.0 else normed).astype(compute_dtype)


# -- norm_matvec --------------------------------------------------------------------------------------------
def _norm_ends(
    x: jax.Array,
    offset: int,
    k: int,
    scale: jax.Array | None,
    eps: float,
    extra: float,
    tiling: Tiling,
    compute_dtype: jnp.dtype,
) -> tuple[Start, RowTile]:
    """start and row_tile of a product whose row is x[offset: offset + k] (operand 0), normalized with scale
    (operand 1) or not. Unrolled, start loads each of the row's tiles once and returns them normalized."""
    block_k = tiling.fitted(1, k).block_k

    def load(ins, k0, size):
        return ins[0][pl.ds(offset + k0, size)], None if scale is None else ins[1][pl.ds(k0, size)]

    if tiling.unroll:

        def start(ins):
            loaded = {k0: load(ins, k0, size) for k0, size in _unrolled_tiles(k, block_k)}
            inverse = None
            if scale is not None:
                inverse = lax.rsqrt(sum(jnp.sum(jnp.square(v.astype(F32))) for v, _ in loaded.values()) / k + eps)
            return {k0: _normed(v, inverse, s, extra, x.dtype, compute_dtype) for k0, (v, s) in loaded.items()}

        return start, lambda ins, normed, k0, size: normed[k0]

    def start(ins):
        return _rms_inverse(ins[0], offset, k, block_k, eps) if scale is not None else None

    def row_tile(ins, inverse, k0, size):
        row, scales = load(ins, k0, size)
        return _normed(row, inverse, scales, extra, x.dtype, compute_dtype)

    return start, row_tile


def norm_matvec(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None = None,
    *,
    eps: float = 1e-5,
    extra: float = 1.0,
    offset: int = 0,
    out_dtype: jnp.dtype | None = None,
    tiling: Tiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W a for W [N, K] and the row x[offset: offset + K] (x float32 or the compute dtype, possibly longer):
    a = bf16(rms_norm(row, scale) * extra), or the row in W's dtype when scale is None. Returns [N] in out_dtype
    (default W's dtype) from a float32 accumulation."""
    n, k = w.shape
    if x.ndim != 1 or x.shape[0] < offset + k or (scale is not None and scale.shape != (k,)):
        raise ValueError(
            f"norm_matvec: W {w.shape} takes {k} values of the row from {offset}; got a row of "
            f"{x.shape} and scale {None if scale is None else scale.shape}"
        )
    tiling = tiling or default_tiling(k)
    start, row_tile = _norm_ends(x, offset, k, scale, eps, extra, tiling, w.dtype)
    operands = (x, w[None]) if scale is None else (x, scale, w[None])
    specs = [_whole(a.shape) for a in operands[:-1]] + [_weight_rows(1, k)]
    out_dtype = out_dtype or w.dtype
    return _row_product(
        operands,
        specs,
        len(operands) - 1,
        start,
        row_tile,
        lambda ins, sums: sums[0].astype(out_dtype),
        jax.ShapeDtypeStruct((n,), out_dtype),
        tiling,
        "norm_matvec",
        interpret,
    )


def norm_matvec_reference(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None = None,
    *,
    eps: float = 1e-5,
    extra: float = 1.0,
    offset: int = 0,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    a = _norm_reference(x[offset : offset + w.shape[1]], scale, eps, extra, w.dtype)
    return jnp.einsum("k,nk->n", a, w, preferred_element_type=F32).astype(out_dtype or w.dtype)


# -- swiglu_norm_matvec -------------------------------------------------------------------------------------
def _swiglu(gate: jax.Array, up: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """jax.nn.silu(gate) * up on values of `dtype`: the sigmoid expanded to 1 / (1 + exp(-gate)) and each operation
    rounded to `dtype`, as XLA computes it on a bf16 graph."""
    rounded = lambda v: v.astype(dtype).astype(F32)
    gate, up = rounded(gate), rounded(up)
    sigmoid = rounded(1.0 / rounded(1.0 + rounded(jnp.exp(-gate))))
    return (rounded(gate * sigmoid) * up).astype(dtype)


def swiglu_norm_matvec(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    *,
    eps: float = 1e-5,
    tiling: Tiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The SwiGLU's first half for one row x [K] float32: silu(W_gate a) * (W_up a) with a = bf16(rms_norm(x,
    scale)) and w = [2, F, K] (gate, up). Returns [F] in W's dtype."""
    (k,), (two, f, k_w) = x.shape, w.shape
    if two != 2 or k != k_w:
        raise ValueError(f"swiglu_norm_matvec: W must be [2, F, {k}] (gate, up); got {w.shape}")
    tiling = tiling or swiglu_tiling(k)
    start, row_tile = _norm_ends(x, 0, k, scale, eps, 1.0, tiling, w.dtype)
    return _row_product(
        (x, scale, w),
        [_whole((k,)), _whole((k,)), _weight_rows(2, k)],
        2,
        start,
        row_tile,
        lambda ins, sums: _swiglu(*sums, w.dtype),
        jax.ShapeDtypeStruct((f,), w.dtype),
        tiling,
        "swiglu_norm_matvec",
        interpret,
    )


def swiglu_norm_matvec_reference(x: jax.Array, w: jax.Array, scale: jax.Array, *, eps: float = 1e-5) -> jax.Array:
    a = _norm_reference(x, scale, eps, 1.0, w.dtype)
    both = jnp.einsum("k,gfk->gf", a, w, preferred_element_type=F32).astype(w.dtype)
    return jax.nn.silu(both[0]) * both[1]


# -- matvec_add ---------------------------------------------------------------------------------------------
def matvec_add(
    h: jax.Array, w: jax.Array, residual: jax.Array, *, tiling: Tiling | None = None, interpret: bool = False
) -> jax.Array:
    """residual + W h for one row h [K] in W's dtype, W [N, K] and residual [N] (float32): the product rounded
    to W's dtype, then added in the residual's dtype, as `x + project(h, W)` computes it."""
    (k,), (n, k_w) = h.shape, w.shape
    if k != k_w or residual.shape != (n,):
        raise ValueError(f"matvec_add: h {h.shape}, W {w.shape} and residual {residual.shape} do not match")
    tiling = tiling or default_tiling(k)

    def row_tile(ins, started, k0, size):
        return ins[0][pl.ds(k0, size)].astype(F32)

    def finish(ins, sums):
        return ins[2][...] + sums[0].astype(w.dtype).astype(residual.dtype)

    return _row_product(
        (h, w[None], residual),
        [_whole((k,)), _weight_rows(1, k), _program_rows],
        1,
        lambda ins: None,
        row_tile,
        finish,
        jax.ShapeDtypeStruct((n,), residual.dtype),
        tiling,
        "matvec_add",
        interpret,
    )


def matvec_add_reference(h: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array:
    return residual + jnp.einsum("k,nk->n", h, w, preferred_element_type=F32).astype(w.dtype).astype(residual.dtype)
