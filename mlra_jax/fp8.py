"""FP8 training matmuls (`model.matmul_dtype=float8`): the projections' products on FP8 tensor cores.

Each product x [M, K] @ W [K, N] runs as cuBLASLt FP8 GEMMs with per-tensor dynamic scaling (the scale of a
tensor is its absolute maximum over the format's largest value, taken when the tensor is made, as
torchao's tensorwise float8 does): the forward multiplies e4m3 activations by e4m3 weights, the backward
multiplies the e5m2 output gradient by each. Every GEMM is written with both operands contracting over
their last axis, the one layout in which Hopper's FP8 GEMMs run at full rate; the transposed copies it
needs are made by the quantizing fusions. Products accumulate in float32 and are written in the compute
dtype; the scales are applied to the output, where XLA fuses them into the next elementwise work. Under a
remat policy that keeps the products, the quantized operands are made again in the backward (elementwise
passes), not kept.

Only training takes this path (the loss function turns it on); evaluation, decoding and export run in
the compute dtype. A backend without FP8 GEMMs (a CPU, a GPU before compute capability 8.9) is reported
once and trains in the compute dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import re
from typing import Iterator

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_MAX = {E4M3: float(jnp.finfo(E4M3).max), E5M2: float(jnp.finfo(E5M2).max)}  # 448, 57344

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("mlra_jax_fp8_matmuls", default=False)
# "bt<contracted>,<contracted><out>->bt<out>": x's leading batch and time axes, its other axes contracted
_PROJECTION = re.compile(r"^bt(\w+),(\w+)->bt(\w+)$")


def scale_of(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The per-tensor scale that maps x's absolute maximum onto `dtype`'s largest value (1 for a zero x)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / _MAX[dtype], 1.0)


def quantize(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x / scale in `dtype` (saturating at its largest value)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -_MAX[dtype], _MAX[dtype]).astype(dtype)


def _gemm(a: jax.Array, b: jax.Array, scale: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """a [M, K] . b [N, K] -> [M, N] (both contracting their last axis), times `scale`, in `out_dtype`. The GEMM
    accumulates in float32 and writes `out_dtype`, so that a remat policy that keeps the products keeps them
    in the compute dtype, as it does without FP8 (and as remat="auto" estimates)."""
    product = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)
    return (product.astype(jnp.float32) * scale).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_matmul(x: jax.Array, w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N], both and the result (and the gradients) in `dtype`, with FP8 operands in
    the forward and the backward."""
    return _forward(x, w, dtype)[0]


def _forward(x: jax.Array, w: jax.Array, dtype: jnp.dtype):
    x_scale, w_scale = scale_of(x, E4M3), scale_of(w, E4M3)
    x8, w8_t = quantize(x, x_scale, E4M3), quantize(w.T, w_scale, E4M3)  # w8_t [N, K]
    return _gemm(x8, w8_t, x_scale * w_scale, dtype), (x8, w8_t, x_scale, w_scale)


def _backward(dtype: jnp.dtype, residuals, grad: jax.Array):
    x8, w8_t, x_scale, w_scale = residuals
    g_scale = scale_of(grad, E5M2)
    g8 = quantize(grad, g_scale, E5M2)  # [M, N]
    grad_x = _gemm(g8, w8_t.T, g_scale * w_scale, dtype)  # [M, N] . [K, N] -> [M, K]
    grad_w = _gemm(x8.T, g8.T, x_scale * g_scale, dtype)  # [K, M] . [N, M] -> [K, N]
    return grad_x, grad_w


fp8_matmul.defvjp(_forward, _backward)


def fp8_project(x: jax.Array, w: jax.Array, spec: str, dtype: jnp.dtype) -> jax.Array | None:
    """einsum(spec, x, w) through fp8_matmul when `spec` is a projection (x [B, T, in...], w [in..., out...],
    out [B, T, out...]); None for any other product."""
    match = _PROJECTION.match(spec.replace(" ", ""))
    if match is None:
        return None
    x_in, w_axes, out = match.groups()
    if not w_axes.startswith(x_in) or w_axes[len(x_in) :] != out:
        return None
    batch, time = x.shape[:2]
    contracted = math.prod(x.shape[2:])
    x, w = x.astype(dtype), w.astype(dtype)
    result = fp8_matmul(x.reshape(batch * time, contracted), w.reshape(contracted, -1), dtype)
    return result.reshape(batch, time, *w.shape[len(x_in) :])


def active() -> bool:
    """Whether projections run through FP8 here (inside `matmuls`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def matmuls(enabled: bool) -> Iterator[None]:
    """Inside: the projections of a model traced here run as FP8 matmuls when `enabled`."""
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def supported(device: jax.Device | None = None) -> bool:
    """Whether the device has FP8 GEMMs: an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper, ...)."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return False
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return (major, minor) >= (8, 9)


@functools.cache
def _report_fallback(kind: str) -> None:
    log.warning(
        "model.matmul_dtype=float8: %s has no FP8 GEMMs (an NVIDIA GPU of compute capability 8.9 or later "
        "does); training in the compute dtype",
        kind,
    )


def training_matmuls(matmul_dtype: str, device: jax.Device | None = None) -> bool:
    """Whether a train step for `matmul_dtype` takes the FP8 path on `device` (a fallback is logged once)."""
    if matmul_dtype != "float8":
        return False
    device = device or jax.devices()[0]
    if supported(device):
        return True
    _report_fallback(device.device_kind)
    return False


def describe(matmul_dtype: str, device: jax.Device | None = None) -> str:
    """One line on how a train step's projections run on `device` (for --dry_run)."""
    if matmul_dtype != "float8":
        return "projections: the compute dtype"
    device = device or jax.devices()[0]
    if supported(device):
        return f"projections: FP8 GEMMs (e4m3 / e5m2, per-tensor dynamic scaling) on {device.device_kind}"
    return f"projections: float8 asked for, but {device.device_kind} has no FP8 GEMMs: the compute dtype"
