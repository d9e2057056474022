"""The latent decode kernels in the model: the kernel for the backend, run per data-parallel shard.

The kernels (mlra_jax.pallas_kernels) are pure functions of per-sequence slot ranges; this
module turns the model's decode mask into those ranges, picks the kernel for the backend
(GPU: Mosaic GPU, TPU: Mosaic TPU) and runs it on each data-parallel shard of the batch
under a mesh (GSPMD cannot partition a kernel).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from mlra_jax.attention.fused import BATCH_AXES


def ranges_from_mask(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) [B] of the contiguous valid slots of a decode mask [B, 1, S] or [B, S].

    One fused sum/max reduction (an argmax over a long cache costs tens of microseconds on GPUs)."""
    valid = mask.reshape(mask.shape[0], -1)
    ends = jnp.max(jnp.where(valid, jnp.arange(1, valid.shape[1] + 1, dtype=jnp.int32), 0), axis=-1)
    return ends - jnp.sum(valid, axis=-1, dtype=jnp.int32), ends


def kernel_for_backend() -> Callable[..., jax.Array]:
    """The kernel for the default backend (GPU: Mosaic GPU, TPU: Mosaic TPU)."""
    backend = jax.default_backend()
    if backend == "gpu":
        from mlra_jax.pallas_kernels.latent_decode_gpu import latent_decode_gpu

        return latent_decode_gpu
    if backend == "tpu":
        from mlra_jax.pallas_kernels.latent_decode_tpu import latent_decode_tpu

        return latent_decode_tpu
    raise ValueError(f"attention_impl='pallas' needs a GPU or TPU; the backend is {backend!r} (the kernels run on "
                     f"CPU only in the tests' interpret mode); use attention_impl='xla'")


def _automatic_batch_axes() -> tuple[str, ...]:
    """Data-parallel mesh axes still under GSPMD here (a kernel cannot be partitioned by it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = jax.sharding.AxisType.Manual
    return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                 if name in BATCH_AXES and kind != manual and mesh.shape[name] > 1)


def latent_decode_attention(q_rope: jax.Array, q_latent: jax.Array, k_rope: jax.Array, latent: jax.Array, *,
                            scale: float, mask: jax.Array) -> jax.Array:
    """The model's entry point (core.latent_attention, impl='pallas'): one decode token.

    q_rope [B, 1, N, H, Dr], q_latent [B, 1, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R],
    mask [B, 1, S] (a contiguous range per sequence) -> [B, 1, N, H, R]. Under a mesh, each
    data-parallel shard of the batch runs the kernel on its own sequences."""
    if q_rope.shape[1] != 1:
        raise ValueError(f"the Pallas latent kernel decodes one token at a time; got {q_rope.shape[1]} (prefill "
                         f"runs unabsorbed on XLA)")
    kernel = kernel_for_backend()
    starts, ends = ranges_from_mask(mask)

    def run(q_rope, q_latent, k_rope, latent, starts, ends):
        return kernel(q_rope, q_latent, k_rope, latent, starts, ends, scale=scale)

    axes = _automatic_batch_axes()
    mesh = jax.sharding.get_abstract_mesh()
    in_tp_region = not mesh.empty and jax.sharding.AxisType.Manual in mesh.axis_types
    if axes and in_tp_region and jax.default_backend() == "gpu":
        # Seen on 8 x H200 (jax 0.11.2): XLA aborts compiling a Mosaic GPU kernel in a data-parallel
        # shard_map nested in the tensor-parallel one. TP alone and DP alone are the supported layouts.
        raise ValueError("attention_impl='pallas' on GPUs supports tensor parallelism or data parallelism, not both "
                         "at once (XLA fails to compile the nested kernel); set mesh.data=1 or use "
                         "attention_impl='xla'")
    if axes:
        shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
        if q_rope.shape[0] % shards:
            raise ValueError(f"a batch of {q_rope.shape[0]} cannot be split over the {shards} data-parallel devices "
                             f"{axes}; use a batch that is a multiple of {shards}")
        batch = jax.sharding.PartitionSpec(axes)
        run = jax.shard_map(run, in_specs=(batch,) * 6, out_specs=batch, axis_names=set(axes), check_vma=False)
    return run(q_rope[:, 0], q_latent[:, 0], k_rope, latent, starts, ends)[:, None]
