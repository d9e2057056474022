"""Pallas's GPU interpret mode for the Mosaic GPU kernels (on a CPU, for the tests)."""

from __future__ import annotations

from typing import Any

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(interpret: bool) -> Any:
    """plgpu.kernel's `interpret` argument: GPU interpret mode's parameters where `interpret` (exported as
    plgpu.InterpretGPUParams in later jax versions), else None (compiled for the GPU)."""
    if not interpret:
        return None
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
