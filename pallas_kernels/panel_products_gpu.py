"""Products of a panel of rows (16 to 128: a decode step's batch on one device) with a weight matrix, as Pallas
Triton kernels (GPUs).

At 16-128 rows a product reads its weight once and does 16-128 multiply-adds per weight element: it is bound by
the weight's bytes, as batch-1 products are. cuBLAS runs these shapes as split-K GEMMs at about half of the copy
bandwidth on an H100 (the 2.9B models' decode steps at batch 64 over 4 GPUs). Here every program streams a
[block_k, block_n] column tile of W through shared memory `num_stages` deep and multiplies it with the panel's
[rows, block_k] tile on tensor cores (Triton's dot), the panel re-read from L2. Splitting K over `split_k` programs
fills the GPU where N alone gives too few; the partial sums then meet in one XLA fusion with the epilogue.

* panel_matmul:        x W for x [M, K] and W [K, N] (the serving layouts are input-major);
* swiglu_panel_matmul: silu(x W_gate) * (x W_up) for W [K, 2, N] (gate, up), with the SwiGLU's roundings.

Each has a jnp reference (`*_reference`) with the same roundings (the product rounded once from float32), which
the tests check the kernels against in interpret mode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from mlra_jax.pallas_kernels.row_products_gpu import swiglu_rounded

F32 = jnp.float32
MIN_ROWS, MAX_ROWS = 16, 128  # a tensor-core dot takes at least 16 rows; above 128 cuBLAS's tiles are the right ones


@dataclasses.dataclass(frozen=True)
class PanelTiling:
    """How the programs split a product: `block_n` columns of W per program, K in `split_k` chunks (a program
    each) walked in tiles of `block_k` (the largest power of two up to it that divides the chunk)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        if min(self.block_n, self.block_k, self.split_k, self.num_warps, self.num_stages) < 1:
            raise ValueError(f"a panel tiling takes positive sizes; got {self}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two of at least 16 (a tensor-core dot's N); got {self}")

    def chunk_tile(self, k: int) -> tuple[int, int]:
        """(the K chunk of one program, the K tile it walks in) for K inputs."""
        if k % self.split_k:
            raise ValueError(f"split_k={self.split_k} does not divide K={k}")
        chunk = k // self.split_k
        tile = 16
        while tile * 2 <= self.block_k and chunk % (tile * 2) == 0:
            tile *= 2
        if chunk % tile:
            raise ValueError(f"the panel kernels take K chunks in multiples of 16; got {chunk} (K={k})")
        return chunk, tile

    def params(self) -> pltriton.CompilerParams:
        return pltriton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def default_tiling(k: int, n: int, groups: int = 1, sms: int = 132) -> PanelTiling:
    """A tiling with at least one program per SM: 64 columns per program (32 where N is short), K split in the
    fewest chunks (at most 8) that give the programs."""
    block_n = 64 if n // 64 * groups >= sms // 2 else 32
    split = 1
    while (n // block_n) * split < sms and split < 8 and k % (split * 2 * 16) == 0:
        split *= 2
    return PanelTiling(block_n=block_n, block_k=128, split_k=split)


def panel_problem(x: jax.Array, w: jax.Array, tiling: PanelTiling | None = None) -> str | None:
    """Why the panel kernels do not take x [M, K] and W [K, ..., N], or None when they do."""
    m, k = x.shape
    n = w.shape[-1]
    if w.shape[0] != k:
        return f"W {w.shape} does not take K={k}"
    if not MIN_ROWS <= m <= MAX_ROWS or m % 16:
        return f"{m} rows: the panel kernels take multiples of 16 from {MIN_ROWS} to {MAX_ROWS}"
    if jnp.dtype(w.dtype).itemsize != 2 or x.dtype != w.dtype:
        return f"the panel kernels take 16-bit x and W of one dtype; got {x.dtype} and {w.dtype}"
    t = tiling or default_tiling(k, n, w.size // (k * n))
    if n % t.block_n:
        return f"N={n} is not a multiple of block_n={t.block_n}"
    try:
        t.chunk_tile(k)
    except ValueError as err:
        return str(err)
    return None


def _panel_sums(x: jax.Array, w: jax.Array, tiling: PanelTiling, interpret: bool) -> jax.Array:
    """The float32 sums x W for W [K, G, N]: [split_k, G, M, N], one K chunk's sums each."""
    (m, k), (_, g, n) = x.shape, w.shape
    chunk, tile = tiling.chunk_tile(k)
    steps, bn = chunk // tile, tiling.block_n

    def kernel(x_ref, w_ref, out_ref):
        def step(i, accs):
            k0 = pl.multiple_of(i * tile, tile)
            a = x_ref[:, pl.ds(k0, tile)]
            return [
                acc + lax.dot(a, w_ref[pl.ds(k0, tile), j, :], preferred_element_type=F32) for j, acc in enumerate(accs)
            ]

        accs = lax.fori_loop(0, steps, step, [jnp.zeros((m, bn), F32)] * g)
        for j, acc in enumerate(accs):
            out_ref[j, :, :] = acc

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tiling.split_k, g, m, n), F32),
        grid=(n // bn, tiling.split_k),
        in_specs=[
            pl.BlockSpec((m, chunk), lambda j, s: (0, s)),
            pl.BlockSpec((chunk, g, bn), lambda j, s: (s, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, g, m, bn), lambda j, s: (s, 0, 0, j)),
        compiler_params=tiling.params(),
        interpret=interpret,
        name="panel_matmul",
    )(x, w)


def _checked(x: jax.Array, w: jax.Array, tiling: PanelTiling | None, groups: int, name: str) -> PanelTiling:
    if w.ndim != 3 or w.shape[1] != groups:
        raise ValueError(f"{name}: W must be [K, {groups}, N]; got {w.shape}")
    problem = panel_problem(x, w, tiling)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return tiling or default_tiling(x.shape[1], w.shape[-1], groups)


def panel_matmul(
    x: jax.Array, w: jax.Array, *, tiling: PanelTiling | None = None, interpret: bool = False
) -> jax.Array:
    """x W for x [M, K] and W [K, N] (16-bit, one dtype): [M, N] in W's dtype from float32 sums."""
    w3 = w[:, None, :]
    t = _checked(x, w3, tiling, 1, "panel_matmul")
    return jnp.sum(_panel_sums(x, w3, t, interpret), axis=0)[0].astype(w.dtype)


def panel_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("mk,kn->mn", x, w, preferred_element_type=F32).astype(w.dtype)


def swiglu_panel_matmul(
    x: jax.Array, w: jax.Array, *, tiling: PanelTiling | None = None, interpret: bool = False
) -> jax.Array:
    """silu(x W_gate) * (x W_up) for x [M, K] and W [K, 2, N] (gate, up): each product rounded to W's dtype, then
    the SwiGLU with its roundings (row_products_gpu.swiglu_rounded). Returns [M, N] in W's dtype."""
    t = _checked(x, w, tiling, 2, "swiglu_panel_matmul")
    both = jnp.sum(_panel_sums(x, w, t, interpret), axis=0)
    return swiglu_rounded(both[0], both[1], w.dtype)


def swiglu_panel_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    both = jnp.einsum("mk,kgn->gmn", x, w, preferred_element_type=F32).astype(w.dtype)
    return jax.nn.silu(both[0]) * both[1]
