"""Which FP8 operands one Pallas Triton kernel quantizes in both layouts (`model.fp8_casts`).

An FP8 training product needs its activation x and its output gradient quantized twice, straight for one GEMM
and transposed for the weight gradient's (mlra_jax.fp8). `pallas_kernels.fp8_cast_gpu` reads each once and writes
both layouts and the amax; on an H200 XLA's fusion of the same takes 1.9-2.2x its bytes' time at the copy
bandwidth, the kernel 1.0-1.2x (experiments/results/elementwise_h200.json, fp8_cast_h200.json).

* "auto" and "kernel" take the kernel on NVIDIA GPUs for activations and gradients whose rows (the batch's
  tokens) are whole on each device or split over the data-parallel axes alone: each device then quantizes its
  rows in a shard_map and the amax is the maximum over the devices. Under tensor parallelism, and for weights
  (small, and sharded as FSDP gathers them), XLA's fusion runs. "kernel" elsewhere logs one line and runs XLA's.
* "xla": XLA's fusions everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from typing import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlra_jax.config import FP8_CASTS
from mlra_jax.platform import nvidia_gpu_problem
from mlra_jax.sharding import automatic_axes, split_batch_axes

log = logging.getLogger(__name__)

# The kernel in Pallas interpret mode wherever the code runs (the tests, on CPU); never set in the library.
INTERPRET = False

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("mlra_jax_fp8_cast_kernel", default=False)


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


def kernel_runs(setting: str) -> bool:
    """Whether fp8_casts=`setting` takes the kernel on this backend (a "kernel" that cannot is logged once)."""
    if setting not in FP8_CASTS:
        raise ValueError(f"fp8_casts={setting!r}: use one of {', '.join(FP8_CASTS)}")
    if setting == "xla":
        return False
    problem = None if INTERPRET else nvidia_gpu_problem("the FP8 cast kernel runs")
    if problem is not None and setting == "kernel":
        _log_once(f"fp8_casts='kernel': XLA quantizes the FP8 operands ({problem})")
    return problem is None


@contextlib.contextmanager
def casts(setting: str) -> Iterator[None]:
    """Inside: FP8 operands traced here are quantized as fp8_casts=`setting` says."""
    token = _ON.set(kernel_runs(setting))
    try:
        yield
    finally:
        _ON.reset(token)


def active() -> bool:
    """Whether the enclosing `casts` takes the kernel (fp8 passes this to its custom VJPs' backward)."""
    return _ON.get()


def _row_axes(rows: int, cols: int, multiple: int) -> tuple[str, ...] | None:
    """The mesh axes each device's rows split over (() outside a mesh), or None where the kernel does not apply:
    another automatic axis splits the work (tensor parallelism), the rows do not split into whole multiples of
    `multiple` (each device pads its own rows, which must then need no padding), or a device's operand is too large
    for the kernel's int32 offsets."""
    from mlra_jax.pallas_kernels.fp8_cast_gpu import fits

    auto = automatic_axes()
    axes = split_batch_axes(rows)
    if any(size > 1 and name not in axes for name, size in auto.items()):
        return None
    per_device = rows // math.prod(auto[a] for a in axes) if axes else rows
    if (axes and per_device % multiple) or not fits(per_device, cols, multiple):
        return None
    return axes


def both_layouts(
    x: jax.Array, inverse_scale: jax.Array, dtype: jnp.dtype, pad_to: int, kernel: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, q_t, amax) of an activation or gradient x [rows, cols]: x padded with zeros to multiples of pad_to and
    quantized, its transpose, and max |x|. On the kernel (fp8_cast_gpu.quantize_both) where `kernel` and the mesh
    allow, else by XLA (its jnp reference, whose two layouts and amax XLA fuses into one pass)."""
    from mlra_jax.pallas_kernels.fp8_cast_gpu import quantize_both, quantize_both_reference

    axes = _row_axes(*x.shape, pad_to) if kernel else None
    if axes is None:
        return quantize_both_reference(x, inverse_scale, dtype, pad_to)
    run = functools.partial(quantize_both, dtype=dtype, pad_to=pad_to, interpret=INTERPRET)
    if not axes:
        return run(x, inverse_scale)

    def per_device(x, inverse_scale):
        q, q_t, amax = run(x, inverse_scale)
        return q, q_t, jax.lax.pmax(amax, axes)

    rows = P(axes, None)
    return jax.shard_map(
        per_device,
        in_specs=(rows, P()),
        out_specs=(rows, P(None, axes), P()),
        axis_names=set(automatic_axes()),
        check_vma=False,
    )(x, inverse_scale)
