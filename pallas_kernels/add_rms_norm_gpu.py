"""The residual add and the RMSNorm after it as Pallas Triton kernels (NVIDIA GPUs): one pass each way.

    stream = x + branch                       (x the residual stream, branch what a sublayer adds to it)
    normed = rms_norm(stream, scale)          (layers.rms_norm: float32 statistics, the weight applied last)

Forward, one program per `block_rows` rows: reads x and the branch once, writes the new stream, the normed rows
(in `out_dtype`, what the next products read: bf16 for a bf16 model) and each row's 1 / rms (`rstd`, float32).
Backward, one program per run of rows: reads the normed rows' cotangent, the stream, the stream's own incoming
cotangent and rstd once, and writes the stream's cotangent (that of x, and of the branch in its dtype); each
program sums the weight's gradient over its rows in float32, and the partial sums are added after. Rows are
loaded in power-of-two column chunks (Triton's tensors are powers of two: d = 3072 is 2048 + 1024).

`add_rms_norm` is the pair under `jax.custom_vjp`; `add_rms_norm_reference` the same math in jnp, as the model
computes it. Without a branch (branch None) it is the RMSNorm alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
# Every pallas_call of the elementwise kernels is named with this prefix (remat policies that keep kernel outputs
# leave these to be recomputed, as XLA's fusions are).
NAME_PREFIX = "fused_elementwise_"


@dataclasses.dataclass(frozen=True)
class Tiling:
    """block_rows: rows per forward program and per backward step (a power of two; fewer where it does not
    divide the rows); num_warps: Triton's warps per program; programs: the backward's programs at most (each
    loops over its run of rows and writes one partial sum of the weight's gradient)."""

    block_rows: int = 1
    num_warps: int = 4
    programs: int = 1056  # 8 per SM of an H100

    def __post_init__(self) -> None:
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1) or min(self.num_warps, self.programs) < 1:
            raise ValueError(f"a norm tiling takes a power-of-two block_rows and positive counts; got {self}")

    def params(self) -> pltriton.CompilerParams:
        return pltriton.CompilerParams(num_warps=self.num_warps, num_stages=1)


DEFAULT_TILING = Tiling()


def column_chunks(d: int) -> tuple[tuple[int, int], ...]:
    """The row's columns as power-of-two chunks (offset, size), largest first: 3072 -> (0, 2048), (2048, 1024)."""
    chunks, offset = [], 0
    for bit in reversed(range(d.bit_length())):
        if d & (1 << bit):
            chunks.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(chunks)


def _dividing_power(n: int, at_most: int) -> int:
    """The largest power of two that divides n and is at most `at_most`."""
    power = 1
    while power * 2 <= at_most and n % (power * 2) == 0:
        power *= 2
    return power


def backward_runs(rows: int, tiling: Tiling) -> tuple[int, int]:
    """(rows per step, steps per program) of the backward: steps a power of two, as few as keep the programs
    at most tiling.programs."""
    block = _dividing_power(rows, tiling.block_rows)
    blocks = rows // block
    steps = 1
    while blocks // steps > tiling.programs and blocks % (steps * 2) == 0:
        steps *= 2
    return block, steps


def _dtypes(x: jax.Array, branch: jax.Array | None, scale: jax.Array) -> tuple[jnp.dtype, jnp.dtype]:
    """(the stream's dtype, that of the normed rows times the weight) as jnp promotes them in the model."""
    stream = x.dtype if branch is None else jnp.result_type(x.dtype, branch.dtype)
    return jnp.dtype(stream), jnp.dtype(jnp.result_type(stream, scale.dtype))


def _rows(a: jax.Array) -> jax.Array:
    return a.reshape(-1, a.shape[-1])


# -- forward ----------------------------------------------------------------------------------------------------
def _forward_kernel(*refs, chunks, d, eps, has_branch, stream_dtype, scaled_dtype):
    if has_branch:
        x_ref, b_ref, w_ref, s_ref, y_ref, rstd_ref = refs
    else:
        (x_ref, w_ref, y_ref, rstd_ref), s_ref = refs, None
    streams = []
    for offset, size in chunks:
        s = x_ref[:, pl.ds(offset, size)].astype(F32)
        if has_branch:
            s = (s + b_ref[:, pl.ds(offset, size)].astype(F32)).astype(stream_dtype)
            s_ref[:, pl.ds(offset, size)] = s
        streams.append(s.astype(F32))
    squares = functools.reduce(lambda a, b: a + b, [jnp.sum(s * s, axis=1) for s in streams])
    rstd = lax.rsqrt(squares / d + eps)
    rstd_ref[...] = rstd
    for (offset, size), s in zip(chunks, streams):
        normed = (s * rstd[:, None]).astype(stream_dtype).astype(F32)
        y = (normed * w_ref[pl.ds(offset, size)].astype(F32)[None, :]).astype(scaled_dtype)
        y_ref[:, pl.ds(offset, size)] = y.astype(y_ref.dtype)


def add_rms_norm_forward(
    x: jax.Array,
    branch: jax.Array | None,
    scale: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype | None = None,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> tuple[jax.Array | None, jax.Array, jax.Array]:
    """x [..., d], branch [..., d] or None, scale [d] -> (the stream x + branch [..., d] (None without a branch),
    the normed stream [..., d] in out_dtype (default: as the model promotes it), rstd [...] float32)."""
    d = x.shape[-1]
    if scale.shape != (d,) or (branch is not None and branch.shape != x.shape):
        raise ValueError(
            f"add_rms_norm: x {x.shape}, branch {None if branch is None else branch.shape} and scale {scale.shape} "
            "do not match"
        )
    stream_dtype, scaled_dtype = _dtypes(x, branch, scale)
    out_dtype = jnp.dtype(out_dtype or scaled_dtype)
    x2 = _rows(x)
    n = x2.shape[0]
    block = _dividing_power(n, tiling.block_rows)
    rows = pl.BlockSpec((block, d), lambda i: (i, 0))
    operands = (x2, scale) if branch is None else (x2, _rows(branch), scale)
    in_specs = [rows] * (len(operands) - 1) + [pl.BlockSpec((d,), lambda i: (0,))]
    out_shape = [jax.ShapeDtypeStruct((n, d), out_dtype), jax.ShapeDtypeStruct((n,), F32)]
    out_specs = [rows, pl.BlockSpec((block,), lambda i: (i,))]
    if branch is not None:
        out_shape.insert(0, jax.ShapeDtypeStruct((n, d), stream_dtype))
        out_specs.insert(0, rows)
    kernel = functools.partial(
        _forward_kernel,
        chunks=column_chunks(d),
        d=d,
        eps=eps,
        has_branch=branch is not None,
        stream_dtype=stream_dtype,
        scaled_dtype=scaled_dtype,
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n // block,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=tiling.params(),
        interpret=interpret,
        name=NAME_PREFIX + "add_rms_norm_fwd",
    )(*operands)
    stream = outs[0].reshape(x.shape) if branch is not None else None
    return stream, outs[-2].reshape(x.shape), outs[-1].reshape(x.shape[:-1])


# -- backward ---------------------------------------------------------------------------------------------------
def _backward_kernel(*refs, chunks, d, block, steps, split_branch, stream_dtype):
    dy_ref, s_ref, g_ref, w_ref, rstd_ref, dx_ref = refs[:6]
    db_ref = refs[6] if split_branch else None
    dw_ref = refs[-1]
    weights = [w_ref[pl.ds(offset, size)].astype(F32)[None, :] for offset, size in chunks]

    def step(j, sums):
        rows = pl.ds(pl.multiple_of(j * block, block), block)
        rstd = rstd_ref[rows][:, None]
        streams = [s_ref[rows, pl.ds(offset, size)].astype(F32) for offset, size in chunks]
        dys = [dy_ref[rows, pl.ds(offset, size)].astype(F32) for offset, size in chunks]
        d_normed = [dy * w for dy, w in zip(dys, weights)]
        dot = functools.reduce(lambda a, b: a + b, [jnp.sum(dn * s, axis=1) for dn, s in zip(d_normed, streams)])
        coefficient = rstd * rstd * rstd * (dot[:, None] / d)
        for (offset, size), s, dn in zip(chunks, streams, d_normed):
            dx = g_ref[rows, pl.ds(offset, size)].astype(F32) + (rstd * dn - coefficient * s)
            dx_ref[rows, pl.ds(offset, size)] = dx.astype(dx_ref.dtype)
            if split_branch:
                db_ref[rows, pl.ds(offset, size)] = dx.astype(db_ref.dtype)
        normed = [(s * rstd).astype(stream_dtype).astype(F32) for s in streams]
        return [total + jnp.sum(dy * nm, axis=0) for total, dy, nm in zip(sums, dys, normed)]

    sums = lax.fori_loop(0, steps, step, [jnp.zeros((size,), F32) for _, size in chunks])
    for (offset, size), total in zip(chunks, sums):
        dw_ref[pl.ds(offset, size)] = total


def add_rms_norm_backward(
    d_normed: jax.Array,
    stream: jax.Array,
    d_stream: jax.Array,
    scale: jax.Array,
    rstd: jax.Array,
    *,
    x_dtype: jnp.dtype,
    branch_dtype: jnp.dtype | None,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """The cotangents of add_rms_norm_forward's inputs from those of its outputs: d_normed and d_stream [..., d]
    (the normed rows' and the stream's), the stream [..., d] and rstd [...] it kept, scale [d] ->
    (dx [..., d] in x_dtype, d_branch in branch_dtype (None without a branch; dx itself where the dtypes are
    the same), d_scale [d] in scale's dtype)."""
    d = stream.shape[-1]
    s2 = _rows(stream)
    n = s2.shape[0]
    block, steps = backward_runs(n, tiling)
    programs = n // (block * steps)
    split_branch = branch_dtype is not None and jnp.dtype(branch_dtype) != jnp.dtype(x_dtype)
    run = pl.BlockSpec((block * steps, d), lambda i: (i, 0))
    in_specs = [run, run, run, pl.BlockSpec((d,), lambda i: (0,)), pl.BlockSpec((block * steps,), lambda i: (i,))]
    out_shape = [jax.ShapeDtypeStruct((n, d), x_dtype)]
    out_specs = [run]
    if split_branch:
        out_shape.append(jax.ShapeDtypeStruct((n, d), branch_dtype))
        out_specs.append(run)
    out_shape.append(jax.ShapeDtypeStruct((programs, d), F32))
    out_specs.append(pl.BlockSpec((None, d), lambda i: (i, 0)))
    kernel = functools.partial(
        _backward_kernel,
        chunks=column_chunks(d),
        d=d,
        block=block,
        steps=steps,
        split_branch=split_branch,
        stream_dtype=stream.dtype,
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(programs,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=tiling.params(),
        interpret=interpret,
        name=NAME_PREFIX + "add_rms_norm_bwd",
    )(_rows(d_normed), s2, _rows(d_stream), scale, rstd.reshape(-1))
    dx = outs[0].reshape(stream.shape)
    d_branch = None if branch_dtype is None else (outs[1].reshape(stream.shape) if split_branch else dx)
    return dx, d_branch, outs[-1].sum(axis=0).astype(scale.dtype)


# -- the pair under custom_vjp ----------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _add_rms_norm(x, branch, scale, eps, out_dtype, tiling, interpret):
    stream, normed, _ = add_rms_norm_forward(
        x, branch, scale, eps=eps, out_dtype=out_dtype, tiling=tiling, interpret=interpret
    )
    return stream, normed


def _add_rms_norm_fwd(x, branch, scale, eps, out_dtype, tiling, interpret):
    stream, normed, rstd = add_rms_norm_forward(
        x, branch, scale, eps=eps, out_dtype=out_dtype, tiling=tiling, interpret=interpret
    )
    # Zero-size arrays carry the inputs' dtypes to the backward.
    dtypes = (jnp.zeros((0,), x.dtype), None if branch is None else jnp.zeros((0,), branch.dtype))
    return (stream, normed), (x if branch is None else stream, scale, rstd, dtypes)


def _add_rms_norm_bwd(eps, out_dtype, tiling, interpret, residuals, cotangents):
    del eps, out_dtype
    stream, scale, rstd, (x_dtype, branch_dtype) = residuals
    d_stream, d_normed = cotangents
    if d_stream is None:  # the RMSNorm alone: no stream output
        d_stream = jnp.zeros(stream.shape, stream.dtype)
    dx, d_branch, d_scale = add_rms_norm_backward(
        d_normed,
        stream,
        d_stream,
        scale,
        rstd,
        x_dtype=x_dtype.dtype,
        branch_dtype=None if branch_dtype is None else branch_dtype.dtype,
        tiling=tiling,
        interpret=interpret,
    )
    return dx, d_branch, d_scale


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


def add_rms_norm(
    x: jax.Array,
    branch: jax.Array | None,
    scale: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype | None = None,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> tuple[jax.Array | None, jax.Array]:
    """(x + branch, rms_norm(x + branch, scale) in out_dtype) on the kernels, differentiable (custom VJP): x, branch
    [..., d] (branch None: (None, rms_norm(x, scale))), scale [d]. out_dtype None: the dtype the model's
    rms_norm gives (the stream's times the weight's)."""
    out_dtype = None if out_dtype is None else jnp.dtype(out_dtype)
    return _add_rms_norm(x, branch, scale, eps, out_dtype, tiling, interpret)


def add_rms_norm_reference(
    x: jax.Array, branch: jax.Array | None, scale: jax.Array, *, eps: float, out_dtype: jnp.dtype | None = None
) -> tuple[jax.Array | None, jax.Array]:
    """add_rms_norm in jnp, as the model computes it (layers.rms_norm after `x + branch`)."""
    stream = x if branch is None else x + branch
    s32 = stream.astype(F32)
    normed = (s32 * lax.rsqrt(jnp.mean(jnp.square(s32), axis=-1, keepdims=True) + eps)).astype(stream.dtype) * scale
    return (None if branch is None else stream), normed.astype(out_dtype or normed.dtype)
