"""Pieces shared by the MLRA attention backward's kernels (mlra_attention_gpu_backward and its fused dQ variant):
wgmma products that interpret mode runs as float32 dots, WGMMA-layout vectors and iotas, the pipeline's depth."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from mlra_jax.pallas_kernels.mlra_attention_gpu import CHUNK, SMEM_BYTES, _layout

TILE = 64  # rows of every tile: a warpgroup's keys (dK/dV) or queries (dQ), and the streamed tiles
MAX_STAGES = 4


class Reg(NamedTuple):
    """A wgmma A operand held in registers (the others are SMEM refs)."""

    value: jax.Array


class TransposedA(NamedTuple):
    """A wgmma A operand read transposed from an SMEM ref (16-bit types)."""

    ref: object


def _lhs(a):
    """The A operand of `mma`'s terms as wgmma takes it."""
    if isinstance(a, Reg):
        return a.value
    return plgpu.transpose_ref(a.ref, (1, 0)) if isinstance(a, TransposedA) else a


def _lhs_value(a) -> jax.Array:
    """The A operand's value, for interpret mode's dots."""
    if isinstance(a, Reg):
        return a.value
    return a.ref[...].T if isinstance(a, TransposedA) else a[...]


def mma(inits: tuple[jax.Array, ...], terms: Callable[[], list], interpret: bool) -> tuple[jax.Array, ...]:
    """inits[i] + the sum of a b (b^T where transposed) over terms() = [(i, a, b, transposed)], a an SMEM ref, a
    Reg or a TransposedA, b an SMEM ref: wgmma into accumulators initialized from inits, all awaited once, on the
    GPU; float32 dots of the same operands in interpret mode. terms() is called inside the accumulators' scope (see
    `_scores` in mlra_attention_gpu: views made outside fail to lower)."""
    if interpret:
        accs = list(inits)
        for i, a, b, transposed in terms():
            lhs = _lhs_value(a)
            dims = (((1,), (1 if transposed else 0,)), ((), ()))
            accs[i] = accs[i] + lax.dot_general(
                lhs, b[...], dims, precision="highest", preferred_element_type=jnp.float32
            )
        return tuple(accs)

    def body(refs):
        for i, a, b, transposed in terms():
            plgpu.wgmma(refs[i], _lhs(a), plgpu.transpose_ref(b, (1, 0)) if transposed else b)

    return tuple(pl.run_state(body)(tuple(plgpu.ACC.init(x) for x in inits)))


def zeros_tile(shape: tuple[int, int], interpret: bool) -> jax.Array:
    return _layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA, interpret)


def vector(ref, axis: int, interpret: bool) -> jax.Array:
    """A [TILE] float32 vector from SMEM in the layout of a WGMMA tile reduced over `axis`."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(axis))


def iota(shape: tuple[int, int], dim: int, interpret: bool) -> jax.Array:
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def stages_that_fit(resident: int, streamed: int, requested: int | None = None) -> int:
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


def smem_transforms(dtype) -> tuple:
    if jnp.dtype(dtype).itemsize == 2:
        return (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128))
    return ()
