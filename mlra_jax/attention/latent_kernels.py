"""The latent decode kernels in the model: backend choice, auto's choice, mask to ranges, one manual region.

The kernels (mlra_jax.pallas_kernels) are pure functions of per-sequence slot ranges; this
module turns the model's decode mask into those ranges, picks the kernel for the backend
(GPU: Mosaic GPU on Hopper, TPU: Mosaic TPU), says whether `attention_impl="auto"` takes
it, and runs it with every mesh axis manual: GSPMD cannot partition a kernel, and a kernel
in a partly automatic region either fails to compile (XLA aborted on 8 x H200, jax 0.11.2,
for a data-parallel region nested in the tensor-parallel one) or cannot lower at all (the
interpret mode's callbacks). The latent TP region (attention/latent.py) is itself manual
over the data axes when decoding, so inside it the kernel runs as it is.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlra_jax.attention.fused import BATCH_AXES, log_once
from mlra_jax.platform import target_platform
from mlra_jax.sharding import automatic_axes

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
KERNEL_CHUNK = 64  # the GPU kernel's tile width: RoPE and latent widths are multiples of it


def ranges_from_mask(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) [B] of the contiguous valid slots of a decode mask [B, 1, S] or [B, S].

    One fused sum/max reduction (an argmax over a long cache costs tens of microseconds on GPUs)."""
    valid = mask.reshape(mask.shape[0], -1)
    ends = jnp.max(jnp.where(valid, jnp.arange(1, valid.shape[1] + 1, dtype=jnp.int32), 0), axis=-1)
    return ends - jnp.sum(valid, axis=-1, dtype=jnp.int32), ends


def kernel_for_backend() -> Callable[..., jax.Array]:
    """The kernel for the default backend (GPU: Mosaic GPU, TPU: Mosaic TPU)."""
    backend = target_platform()
    if backend == "gpu":
        from mlra_jax.pallas_kernels.latent_decode_gpu import latent_decode_gpu

        return latent_decode_gpu
    if backend == "tpu":
        from mlra_jax.pallas_kernels.latent_decode_tpu import latent_decode_tpu

        return latent_decode_tpu
    raise ValueError(
        f"attention_impl='pallas' needs a GPU or TPU; the backend is {backend!r} (the kernels run on "
        f"CPU only in the tests' interpret mode); use attention_impl='xla'"
    )


def kernel_problem(q_rope: jax.Array, latent: jax.Array) -> str | None:
    """Why the Pallas kernel cannot take this decode call on this backend, or None when it can.
    q_rope [B, T, N, H, Dr], latent [B, S, N, R]."""
    if q_rope.shape[1] != 1:
        return f"it decodes one token at a time, not {q_rope.shape[1]}"
    backend = target_platform()
    if backend == "tpu":
        return None
    if backend != "gpu":
        return f"the kernels run on Hopper GPUs and TPUs; the backend is {backend!r}"
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not capability.startswith("9"):
        return f"the Mosaic GPU kernel needs a Hopper GPU (compute capability 9.x), not {capability or 'unknown'}"
    if latent.dtype not in KERNEL_DTYPES:
        return f"the Mosaic GPU kernel takes bfloat16 or float16, not {latent.dtype}"
    if q_rope.shape[-1] % KERNEL_CHUNK or latent.shape[-1] % KERNEL_CHUNK or latent.shape[1] % 8:
        return (
            f"the Mosaic GPU kernel takes RoPE and latent widths in multiples of {KERNEL_CHUNK} and a cache of a "
            f"multiple of 8 slots; got {q_rope.shape[-1]}, {latent.shape[-1]}, {latent.shape[1]}"
        )
    return None


def use_kernel(impl: str, q_rope: jax.Array, latent: jax.Array) -> bool:
    """Whether a latent decode call runs on the Pallas kernel: always for 'pallas' (the kernel's own errors
    say why it cannot), where it runs for 'auto' (logged once when not), never for the others."""
    if impl == "pallas":
        return True
    if impl != "auto":
        return False
    problem = kernel_problem(q_rope, latent)
    if problem is not None:
        log_once(f"attention_impl='auto': latent decode attention runs on XLA ({problem})")
    return problem is None


def latent_decode_attention(
    q_rope: jax.Array, q_latent: jax.Array, k_rope: jax.Array, latent: jax.Array, *, scale: float, mask: jax.Array
) -> jax.Array:
    """The model's entry point (core.latent_attention on the kernel): one decode token.

    q_rope [B, 1, N, H, Dr], q_latent [B, 1, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R],
    mask [B, 1, S] (a contiguous range per sequence) -> [B, 1, N, H, R]. Where mesh axes are still
    automatic, one shard_map makes all of them manual: the batch splits over the data axes and the
    kernel runs on each device's own sequences (nothing is gathered)."""
    if q_rope.shape[1] != 1:
        raise ValueError(
            f"the Pallas latent kernel decodes one token at a time; got {q_rope.shape[1]} (prefill "
            f"runs unabsorbed on XLA)"
        )
    kernel = kernel_for_backend()
    starts, ends = ranges_from_mask(mask)

    def run(q_rope, q_latent, k_rope, latent, starts, ends):
        return kernel(q_rope, q_latent, k_rope, latent, starts, ends, scale=scale)

    auto = automatic_axes()
    if auto:
        batch_axes = tuple(a for a in BATCH_AXES if auto.get(a, 1) > 1)
        shards = math.prod(auto[a] for a in batch_axes)
        if q_rope.shape[0] % shards:
            raise ValueError(
                f"a batch of {q_rope.shape[0]} cannot be split over the {shards} data-parallel devices "
                f"{batch_axes}; use a batch that is a multiple of {shards}"
            )
        batch = P(batch_axes or None)
        run = jax.shard_map(run, in_specs=(batch,) * 6, out_specs=batch, axis_names=set(auto), check_vma=False)
    return run(q_rope[:, 0], q_latent[:, 0], k_rope, latent, starts, ends)[:, None]
