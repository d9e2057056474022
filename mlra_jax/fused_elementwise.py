"""Training's elementwise passes on single-pass Pallas Triton kernels (`model.fused_elementwise`).

* "norms": each residual add with the RMSNorm after it (pallas_kernels.add_rms_norm_gpu): the layers carry the
  stream and the branch still to be added, so the add at the end of a layer runs with the next layer's norm
  (and the last one with the final norm). The normed rows come out in the compute dtype (the products read
  them so), so their cotangent arrives in it too: the sum of their consumers' cotangents rounded once, where
  XLA's path keeps that sum in float32.
* "swiglu": the SwiGLU product's backward (pallas_kernels.swiglu_gpu); its forward stays XLA's (one pass).

"on" takes both, "auto" (the default) those in AUTO_KERNELS (both), "off" neither. The kernels
are Pallas Triton: off NVIDIA GPUs XLA runs the passes ("on", "norms" and "swiglu" log one line saying so).
GSPMD cannot partition a kernel: under a mesh each call runs in a shard_map over the automatic axes, rows split
over the data axes where the batch divides (the SwiGLU's columns over `tensor` too), others redundant.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlra_jax.platform import nvidia_gpu_problem
from mlra_jax.sharding import LOGICAL_RULES, automatic_axes, split_batch_axes

log = logging.getLogger(__name__)

KERNELS = ("norms", "swiglu")
# What fused_elementwise="auto" takes on NVIDIA GPUs: both (one H100, `mlra bench interleaved` with the option off
# and on: the GQA 8-layer proxy's step 2.9% shorter, MLRA-4's 0.5%; train_h100_fused_elementwise_ab.json).
AUTO_KERNELS: frozenset[str] = frozenset(KERNELS)
# The kernels in Pallas interpret mode wherever the code runs (the tests, on CPU); never set in the library.
INTERPRET = False


@functools.cache
def log_once(message: str) -> None:
    log.info(message)


def backend_problem() -> str | None:
    """Why this backend cannot run the kernels (Pallas Triton: NVIDIA GPUs), or None."""
    return None if INTERPRET else nvidia_gpu_problem("the fused elementwise kernels run")


def kernels(setting: str) -> frozenset[str]:
    """The kernels that fused_elementwise=`setting` runs here: "off" none, "on" all, "auto" AUTO_KERNELS, or the
    one named; none off NVIDIA GPUs (logged once unless "auto" or "off")."""
    wanted = {"off": frozenset(), "auto": AUTO_KERNELS, "on": frozenset(KERNELS)}.get(setting, frozenset({setting}))
    if not wanted:
        return wanted
    problem = backend_problem()
    if problem is not None:
        if setting != "auto":
            log_once(f"fused_elementwise={setting!r}: the elementwise passes run on XLA ({problem})")
        return frozenset()
    return wanted


def is_elementwise_kernel(params: dict[str, Any]) -> bool:
    """Whether a pallas_call (its params) is one of these kernels: remat policies that keep the attention kernels'
    outputs recompute these, as they would XLA's fusions."""
    from mlra_jax.pallas_kernels.add_rms_norm_gpu import NAME_PREFIX

    return str(params.get("name") or "").startswith(NAME_PREFIX)


def _on_devices(fn: Callable, in_specs: tuple, out_specs: Any, auto: dict[str, int]) -> Callable:
    """fn as it is outside a mesh, else in a shard_map making every automatic axis manual."""
    if not auto:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(auto), check_vma=False)


# -- residual add + RMSNorm ---------------------------------------------------------------------------------------
def _norm_forward(x, branch, scale, eps, out_dtype):
    from mlra_jax.pallas_kernels.add_rms_norm_gpu import add_rms_norm_forward

    axes, auto = split_batch_axes(x.shape[0]), automatic_axes()
    rows = P(axes or None)

    def run(x, branch, scale):
        stream, normed, rstd = add_rms_norm_forward(x, branch, scale, eps=eps, out_dtype=out_dtype, interpret=INTERPRET)
        return (x if stream is None else stream), normed, rstd

    return _on_devices(run, (rows, rows, P()), (rows, rows, rows), auto)(x, branch, scale)


def _norm_backward(d_normed, stream, d_stream, scale, rstd, x_dtype, branch_dtype):
    from mlra_jax.pallas_kernels.add_rms_norm_gpu import add_rms_norm_backward

    axes, auto = split_batch_axes(stream.shape[0]), automatic_axes()
    rows = P(axes or None)

    def run(d_normed, stream, d_stream, scale, rstd):
        dx, d_branch, d_scale = add_rms_norm_backward(
            d_normed, stream, d_stream, scale, rstd, x_dtype=x_dtype, branch_dtype=branch_dtype, interpret=INTERPRET
        )
        return dx, (dx if d_branch is None else d_branch), d_scale[None]  # per device: summed after

    dx, d_branch, d_scale = _on_devices(run, (rows, rows, rows, P(), rows), (rows, rows, rows), auto)(
        d_normed, stream, d_stream, scale, rstd
    )
    return dx, d_branch, d_scale.sum(axis=0).astype(scale.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _add_rms_norm(x, branch, scale, eps, out_dtype):
    stream, normed, _ = _norm_forward(x, branch, scale, eps, out_dtype)
    return stream, normed


def _add_rms_norm_fwd(x, branch, scale, eps, out_dtype):
    stream, normed, rstd = _norm_forward(x, branch, scale, eps, out_dtype)
    dtypes = (jnp.zeros((0,), x.dtype), None if branch is None else jnp.zeros((0,), branch.dtype))
    return (stream, normed), (stream, scale, rstd, dtypes)


def _add_rms_norm_bwd(eps, out_dtype, residuals, cotangents):
    del eps, out_dtype
    stream, scale, rstd, (x_dtype, branch_dtype) = residuals
    d_stream, d_normed = cotangents
    dx, d_branch, d_scale = _norm_backward(
        d_normed, stream, d_stream, scale, rstd, x_dtype.dtype, None if branch_dtype is None else branch_dtype.dtype
    )
    return dx, (None if branch_dtype is None else d_branch), d_scale


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


def add_rms_norm(
    x: jax.Array, branch: jax.Array | None, scale: jax.Array, eps: float, out_dtype: Any = None
) -> tuple[jax.Array, jax.Array]:
    """(x + branch, layers.rms_norm(x + branch, scale, eps) in out_dtype) on the kernels, differentiable: x and
    branch [B, T, d] (branch None: the norm of x, and x), scale [d]; out_dtype None: the dtype rms_norm gives."""
    return _add_rms_norm(x, branch, scale, eps, None if out_dtype is None else jnp.dtype(out_dtype))


# -- SwiGLU -------------------------------------------------------------------------------------------------------
@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up for gate and up [B, T, f] (one dtype): XLA's forward, the backward on the kernel."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, d_out):
    from mlra_jax.pallas_kernels.swiglu_gpu import swiglu_backward

    gate, up = residuals
    axes, auto = split_batch_axes(gate.shape[0]), automatic_axes()
    (columns,) = LOGICAL_RULES["mlp"]  # the mesh axis the MLP's width splits over (tensor)
    tensor = auto.get(columns, 1)
    spec = P(axes or None, None, columns if tensor > 1 and gate.shape[-1] % tensor == 0 else None)
    run = functools.partial(swiglu_backward, interpret=INTERPRET)
    return _on_devices(run, (spec,) * 3, (spec, spec), auto)(gate, up, d_out.astype(gate.dtype))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
