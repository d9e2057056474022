"""FP8 quantization of a GEMM operand in both layouts at once, as a Pallas Triton kernel (NVIDIA GPUs).

Hopper's FP8 GEMMs take both operands contracting over their contiguous axis, so a training product x [M, K] @
w [K, N] needs each FP8 operand twice: x as [M, K] for the forward and as [K, M] for the weight gradient, the
output gradient as [M, N] and [N, M], w as [N, K] and [K, N]. XLA makes both layouts in one fusion, whose
transposed one-byte stores run at 40-60% of an H200's copy bandwidth. Here a program reads a [rows, cols] tile of
the operand once and writes its quantized tile twice, straight and transposed, plus the tile's absolute maximum
(the amax that delayed scaling records), as Transformer Engine's cast-transpose does.

`quantize_both(x, inverse_scale, dtype)` returns (q [R', C'], q_t [C', R'], amax): x's dims padded with zeros to
multiples of `pad_to`, q = saturate(x * inverse_scale) rounded to `dtype` (round to nearest even), q_t its
transpose, amax = max |x|. `quantize_both_reference` is the same in jnp, which the tests compare the kernel with
in interpret mode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from mlra_jax.pallas_kernels.block_specs import whole_block

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """rows x cols of the operand per program (powers of two) and Triton's warps per program."""

    rows: int = 64
    cols: int = 128
    num_warps: int = 4

    def __post_init__(self) -> None:
        for size in (self.rows, self.cols):
            if size < 16 or size & (size - 1):
                raise ValueError(f"an FP8 cast tiling takes powers of two of at least 16; got {self}")
        if self.num_warps < 1:
            raise ValueError(f"an FP8 cast tiling takes positive warps; got {self}")


DEFAULT_TILING = Tiling()


def _largest(dtype: jnp.dtype) -> float:
    return float(jnp.finfo(dtype).max)


def padded_size(size: int, pad_to: int) -> int:
    """size rounded up to a multiple of pad_to (the FP8 GEMMs take dimensions in multiples of 16)."""
    return size + (-size % pad_to)


INDEX_LIMIT = 2**31  # Triton computes the kernel's offsets in int32


def fits(rows: int, cols: int, pad_to: int = 16) -> bool:
    """Whether an operand [rows, cols] is small enough for the kernel's int32 offsets, padded."""
    return padded_size(rows, pad_to) * padded_size(cols, pad_to) < INDEX_LIMIT


def quantize_both_reference(
    x: jax.Array, inverse_scale: jax.Array, dtype: jnp.dtype, pad_to: int = 16
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, q_t, amax) as the kernel computes them, in jnp."""
    rows, cols = x.shape
    padded = jnp.pad(x, ((0, padded_size(rows, pad_to) - rows), (0, padded_size(cols, pad_to) - cols)))
    largest = _largest(dtype)
    q = jnp.clip(padded.astype(F32) * inverse_scale, -largest, largest).astype(dtype)
    return q, q.T, jnp.max(jnp.abs(x)).astype(F32)


def quantize_both(
    x: jax.Array,
    inverse_scale: jax.Array,
    dtype: jnp.dtype,
    *,
    pad_to: int = 16,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [R, C] (bf16, f16 or f32) quantized to `dtype` (an FP8 type) by inverse_scale (a float32 scalar), in both
    layouts, and max |x|: see the module's docstring. interpret=True runs Pallas's interpreter (CPU tests)."""
    if x.ndim != 2:
        raise ValueError(f"quantize_both takes a 2-D operand; got shape {x.shape}")
    rows, cols = x.shape
    if not fits(rows, cols, pad_to):
        raise ValueError(f"quantize_both indexes in int32: an operand of {rows} x {cols} is too large; split its rows")
    out_rows, out_cols = padded_size(rows, pad_to), padded_size(cols, pad_to)
    grid = (pl.cdiv(out_rows, tiling.rows), pl.cdiv(out_cols, tiling.cols))
    largest = _largest(dtype)
    block_rows, block_cols = tiling.rows, tiling.cols

    def kernel(x_ref, scale_ref, q_ref, q_t_ref, amax_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        r0, c0 = i * block_rows, j * block_cols
        row_ids = r0 + jnp.arange(block_rows, dtype=jnp.int32)
        col_ids = c0 + jnp.arange(block_cols, dtype=jnp.int32)
        inside = (row_ids < rows)[:, None] & (col_ids < cols)[None, :]
        tile = pltriton.load(x_ref.at[pl.ds(r0, block_rows), pl.ds(c0, block_cols)], mask=inside, other=0)
        tile = tile.astype(F32)
        amax_ref[i, j] = jnp.max(jnp.abs(tile))
        q = jnp.clip(tile * scale_ref[0], -largest, largest).astype(dtype)
        written = (row_ids < out_rows)[:, None] & (col_ids < out_cols)[None, :]
        pltriton.store(q_ref.at[pl.ds(r0, block_rows), pl.ds(c0, block_cols)], q, mask=written)
        pltriton.store(q_t_ref.at[pl.ds(c0, block_cols), pl.ds(r0, block_rows)], q.T, mask=written.T)

    q, q_t, amaxes = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((out_rows, out_cols), dtype),
            jax.ShapeDtypeStruct((out_cols, out_rows), dtype),
            jax.ShapeDtypeStruct(grid, F32),
        ),
        grid=grid,
        in_specs=[whole_block(x.shape), whole_block((1,))],
        out_specs=(whole_block((out_rows, out_cols)), whole_block((out_cols, out_rows)), whole_block(grid)),
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=1),
        interpret=interpret,
        name="fp8_quantize_both",
    )(x, jnp.reshape(inverse_scale, (1,)).astype(F32))
    return q, q_t, jnp.max(amaxes)
