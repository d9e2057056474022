"""The SwiGLU product between the MLP's GEMMs, silu(gate) * up, as Pallas Triton kernels (NVIDIA GPUs).

The backward reads gate, up and the product's cotangent once and writes both cotangents (one pass); the forward
reads gate and up once and writes the product. Both work on the arrays flattened, in power-of-two blocks of
elements, in float32 with one rounding to the inputs' dtype at the end (XLA's bf16 graph rounds after each
operation: the results agree to about one bf16 rounding).

`swiglu` is the product under `jax.custom_vjp`, its forward on the kernel or left to XLA (`forward_kernel`:
XLA's fusion of the product is one pass already, and stays free to fuse with its neighbours);
`swiglu_reference` is jax.nn.silu(gate) * up, as the model computes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from mlra_jax.pallas_kernels.add_rms_norm_gpu import NAME_PREFIX

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """block: elements per program (a power of two; smaller where it does not divide the elements);
    num_warps: Triton's warps per program."""

    block: int = 2048
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block < 1 or self.block & (self.block - 1) or self.num_warps < 1:
            raise ValueError(f"a SwiGLU tiling takes a power-of-two block and positive warps; got {self}")

    def params(self) -> pltriton.CompilerParams:
        return pltriton.CompilerParams(num_warps=self.num_warps, num_stages=1)


DEFAULT_TILING = Tiling()


def element_block(size: int, tiling: Tiling) -> int:
    """The largest power of two that divides `size` and is at most tiling.block."""
    block = 1
    while block * 2 <= tiling.block and size % (block * 2) == 0:
        block *= 2
    return block


def _sigmoid(gate: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-gate))


def _forward_kernel(gate_ref, up_ref, out_ref):
    gate = gate_ref[...].astype(F32)
    out_ref[...] = (gate * _sigmoid(gate) * up_ref[...].astype(F32)).astype(out_ref.dtype)


def _backward_kernel(gate_ref, up_ref, d_out_ref, d_gate_ref, d_up_ref):
    gate, up, d_out = (ref[...].astype(F32) for ref in (gate_ref, up_ref, d_out_ref))
    sigmoid = _sigmoid(gate)
    d_up_ref[...] = (d_out * gate * sigmoid).astype(d_up_ref.dtype)
    d_gate_ref[...] = (d_out * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))).astype(d_gate_ref.dtype)


def _elementwise(kernel, operands, outputs: int, name: str, tiling: Tiling, interpret: bool) -> list[jax.Array]:
    """kernel over the operands flattened (same shape and dtype), `outputs` arrays of that shape and dtype out."""
    shape, dtype = operands[0].shape, operands[0].dtype
    if any(a.shape != shape for a in operands):
        raise ValueError(f"swiglu: the operands' shapes differ: {[a.shape for a in operands]}")
    size = operands[0].size
    block = element_block(size, tiling)
    spec = pl.BlockSpec((block,), lambda i: (i,))
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((size,), dtype)] * outputs,
        grid=(size // block,),
        in_specs=[spec] * len(operands),
        out_specs=[spec] * outputs,
        compiler_params=tiling.params(),
        interpret=interpret,
        name=NAME_PREFIX + name,
    )(*(a.reshape(-1) for a in operands))
    return [out.reshape(shape) for out in outs]


def swiglu_forward(
    gate: jax.Array, up: jax.Array, *, tiling: Tiling = DEFAULT_TILING, interpret: bool = False
) -> jax.Array:
    """silu(gate) * up in their dtype (gate and up of one shape and dtype)."""
    return _elementwise(_forward_kernel, (gate, up.astype(gate.dtype)), 1, "swiglu_fwd", tiling, interpret)[0]


def swiglu_backward(
    gate: jax.Array, up: jax.Array, d_out: jax.Array, *, tiling: Tiling = DEFAULT_TILING, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(d_gate, d_up) of silu(gate) * up from the product's cotangent d_out, in gate's dtype."""
    operands = (gate, up.astype(gate.dtype), d_out.astype(gate.dtype))
    d_gate, d_up = _elementwise(_backward_kernel, operands, 2, "swiglu_bwd", tiling, interpret)
    return d_gate, d_up


def swiglu_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The product as layers.MLP computes it."""
    return jax.nn.silu(gate) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _swiglu(gate, up, forward_kernel, tiling, interpret):
    if forward_kernel:
        return swiglu_forward(gate, up, tiling=tiling, interpret=interpret)
    return swiglu_reference(gate, up)


def _swiglu_fwd(gate, up, forward_kernel, tiling, interpret):
    return _swiglu(gate, up, forward_kernel, tiling, interpret), (gate, up)


def _swiglu_bwd(forward_kernel, tiling, interpret, residuals, d_out):
    del forward_kernel
    gate, up = residuals
    d_gate, d_up = swiglu_backward(gate, up, d_out, tiling=tiling, interpret=interpret)
    return d_gate, d_up.astype(up.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(
    gate: jax.Array,
    up: jax.Array,
    *,
    forward_kernel: bool = False,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> jax.Array:
    """silu(gate) * up, differentiable, its backward on the kernel; its forward on the kernel where
    `forward_kernel`, else XLA's (swiglu_reference)."""
    return _swiglu(gate, up, forward_kernel, tiling, interpret)
