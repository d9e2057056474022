"""XLA flags that fast JAX trainers set on NVIDIA GPUs, added to XLA_FLAGS before the backend starts.

From the JAX GPU performance guide and MaxText / JAX-Toolbox recipes, the ones that helped here:
the latency-hiding scheduler, collectives on their own high-priority stream, and combined FSDP
all-gathers and reduce-scatters; and JAX's allocator takes 92% of the GPU's memory, not 75%. A
setting the user already made keeps the user's value; MLRA_JAX_XLA_DEFAULTS=0 adds none.
"""

from __future__ import annotations

import os
import pkgutil

GPU_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 << 20),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 << 20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(64 << 20),
}
# Left out after measuring (experiments/results/README.md): while-loop double buffering and pipelined
# all-gather / reduce-scatter / all-reduce made the 2.9B FSDP step with gradient accumulation use 88.6 GiB
# instead of 65.4 and run at 29.9% MFU instead of 39.7% (MLA, 2 x H200, jax 0.11.2).
DISABLE_VARIABLE = "MLRA_JAX_XLA_DEFAULTS"
# The share of GPU memory JAX's allocator takes (JAX's own default is 0.75: 20 GB of an 80 GB H100 unused).
MEMORY_FRACTION_VARIABLE, GPU_MEMORY_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"


def merged_flags(existing: str, defaults: dict[str, str]) -> str:
    """`existing` XLA_FLAGS plus each default flag it does not set."""
    given = {token.lstrip("-").split("=", 1)[0] for token in existing.split()}
    added = [f"--{name}={value}" for name, value in defaults.items() if name not in given]
    return " ".join([existing.strip(), *added]).strip()


def cuda_plugin_installed() -> bool:
    """Whether JAX can start a CUDA backend here (a jax-cuda plugin) and JAX_PLATFORMS allows it."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    try:
        import jax_plugins
    except ImportError:
        return False
    return any(module.name.startswith("xla_cuda") for module in pkgutil.iter_modules(jax_plugins.__path__))


def apply_gpu_defaults() -> bool:
    """Add GPU_FLAGS to XLA_FLAGS and let JAX take GPU_MEMORY_FRACTION of the GPU's memory (unless the user set
    XLA_PYTHON_CLIENT_MEM_FRACTION) when a CUDA backend can start; call before JAX initializes a backend."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0" or not cuda_plugin_installed():
        return False
    os.environ["XLA_FLAGS"] = merged_flags(os.environ.get("XLA_FLAGS", ""), GPU_FLAGS)
    os.environ.setdefault(MEMORY_FRACTION_VARIABLE, GPU_MEMORY_FRACTION)
    return True
