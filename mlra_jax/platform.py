"""The platform the code being traced will run on: JAX's default backend, or a TPU compiled for ahead of time.

Kernel choices (the fused attention, the decode kernels, GPU-only rewrites of one-row products) follow
`target_platform()`, never `jax.default_backend()` directly, so that a step compiled on a CPU machine for a TPU
topology (`compiling_for("tpu")`, mlra_jax.tpu_compile) takes the TPU's kernels, lowered by Mosaic rather than
run in interpret mode.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("mlra_jax_target_platform", default=None)


def target_platform() -> str:
    """'gpu', 'tpu' or 'cpu': the platform being compiled for (compiling_for), else JAX's default backend."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Trace and lower for `platform` ('tpu', 'gpu' or 'cpu') inside this block, whatever backend runs here."""
    if platform not in ("tpu", "gpu", "cpu"):
        raise ValueError(f"compiling_for({platform!r}): the platform is one of tpu, gpu, cpu")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def nvidia_gpu_problem(runs: str) -> str | None:
    """Why Pallas Triton kernels (NVIDIA GPUs only) cannot run on the target backend, or None; `runs` names them
    with their verb ("the GQA decode kernel runs")."""
    if target_platform() != "gpu":
        return f"{runs} on NVIDIA GPUs; the backend is {target_platform()!r}"
    if "rocm" in getattr(jax.devices()[0].client, "platform_version", "").lower():
        return f"{runs} on NVIDIA GPUs, not ROCm"
    return None
