"""GQA's decode kernel in the model: whether a decode step takes it, and the manual region it runs in.

`attention_impl="pallas"` runs GQA's (and MHA's, MQA's) decode steps, one new token per sequence, on the Pallas
Triton kernel (pallas_kernels.gqa_decode_gpu) on NVIDIA GPUs; prefill stays on XLA, and so does every step on
other backends (logged once). "auto" takes it for bfloat16 and float16 caches on NVIDIA GPUs (AUTO_TAKES_GQA_KERNEL):
on one H100 it reads the cache at 90-105% of the copy bandwidth at batch 64, 2.0-2.3x XLA's path
(experiments/results/decode_attention_gqa_kernel_h100.json).

The kernel reads the cache as stored, so it serves every layout whose devices store the KV heads their query
heads read (tensor_parallel.UnitPlan: split, expanded and aligned plans, and no TP): each device attends over its
own KV heads with its own query heads, gathered per KV head (`HeadTable`), inside one shard_map with every mesh
axis manual (GSPMD cannot partition a kernel; see attention.latent_kernels), its sequences split over the data
axes. A cache replicated under TP (a degree that neither divides nor spreads the KV heads) keeps XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mlra_jax.attention.fused import log_once
from mlra_jax.attention.latent_kernels import ranges_from_mask
from mlra_jax.platform import nvidia_gpu_problem
from mlra_jax.sharding import automatic_axes, split_batch_axes
from mlra_jax.tensor_parallel import TENSOR, UnitPlan, tensor_size

# Whether attention_impl="auto" takes the kernel for GQA's decode steps on NVIDIA GPUs (timed against XLA's path
# with `mlra bench decode attention --variants=gqa4 --impls=xla_as_stored,xla,gqa_kernel`).
AUTO_TAKES_GQA_KERNEL = True
AUTO_DTYPES = (jnp.bfloat16, jnp.float16)
# The kernel in Pallas interpret mode wherever the code runs (the tests, on CPU); never set in the library.
INTERPRET = False


def kernel(tiling=None) -> Callable[..., jax.Array]:
    """The kernel: (q [B, K, G, D], k, v [B, S, K, D], starts, ends [B], *, scale) -> [B, K, G, D], with `tiling`
    (gqa_decode_gpu.Tiling; None: its default)."""
    from mlra_jax.pallas_kernels.gqa_decode_gpu import DEFAULT_TILING, gqa_decode_gpu

    return functools.partial(gqa_decode_gpu, tiling=tiling or DEFAULT_TILING, interpret=INTERPRET)


def backend_problem() -> str | None:
    """Why this backend cannot run the kernel (it is Pallas Triton: NVIDIA GPUs), or None."""
    return None if INTERPRET else nvidia_gpu_problem("the GQA decode kernel runs")


def shape_problem(q: jax.Array, k: jax.Array) -> str | None:
    """Why the kernel cannot take q [B, T, h, D] over the cache k [B, S, stored, D], or None."""
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"the GQA decode kernel takes a power-of-two head dim of at least 16, not {d}"
    if k.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"the GQA decode kernel takes bfloat16, float16 or float32 caches, not {k.dtype}"
    return None


def plan_problem(plan: UnitPlan) -> str | None:
    """Why the cache's layout keeps XLA (its devices do not store the KV heads their query heads read), or None."""
    if tensor_size() != plan.tp:
        return f"the cache is laid out for TP={plan.tp}, the mesh has TP={tensor_size()}"
    if plan.tp > 1 and (not plan.sharded or plan.heads % plan.tp):
        return f"{plan.units} KV heads of {plan.heads} query heads are not stored per device at TP={plan.tp}"
    return None


def use_kernel(impl: str, q: jax.Array, k: jax.Array, plan: UnitPlan) -> bool:
    """Whether this GQA attention call (q [B, T, h, D], the cache k [B, S, stored, D]) runs on the kernel:
    decode steps (T = 1) for "pallas" on NVIDIA GPUs, and for "auto" where AUTO_TAKES_GQA_KERNEL; never prefill
    nor the other impls. "pallas" elsewhere keeps XLA (logged once); on a GPU, a shape the kernel cannot take is an
    error for "pallas" (asked for by name) and XLA for "auto"."""
    if impl not in ("pallas", "auto") or q.shape[1] != 1:
        return False
    if impl == "auto" and (not AUTO_TAKES_GQA_KERNEL or k.dtype not in AUTO_DTYPES):
        return False
    problem = backend_problem() or plan_problem(plan)
    if problem is not None:
        log_once(f"attention_impl={impl!r}: GQA decode attention runs on XLA ({problem})")
        return False
    problem = shape_problem(q, k)
    if problem is not None and impl == "pallas":
        raise ValueError(f"attention_impl='pallas': {problem}; use attention_impl='xla'")
    if problem is not None:
        log_once(f"attention_impl='auto': GQA decode attention runs on XLA ({problem})")
    return problem is None


@dataclasses.dataclass(frozen=True)
class HeadTable:
    """Device d's query heads by the stored KV head (local slot) they read: gather [tp, slots, rows] (a head per
    (slot, row), padding rows repeating a head), back [tp, h / tp] (each head's row in the [slots * rows]
    outputs); None where every device's heads read its slots in order, rows each (a reshape does)."""

    gather: np.ndarray | None
    back: np.ndarray | None
    rows: int

    @classmethod
    def of(cls, plan: UnitPlan, slots: int) -> HeadTable:
        reads = plan.local_heads_slot  # [tp, h / tp]
        local = reads.shape[1]
        if local % slots == 0 and (reads == np.arange(local) // (local // slots)).all():
            return cls(None, None, local // slots)
        rows = max(int((reads[d] == s).sum()) for d in range(plan.tp) for s in range(slots))
        gather = np.zeros((plan.tp, slots, rows), np.int32)
        back = np.zeros(reads.shape, np.int32)
        for d in range(plan.tp):
            for s in range(slots):
                heads = np.flatnonzero(reads[d] == s)
                padded = list(heads) + [heads[0] if len(heads) else 0] * (rows - len(heads))
                gather[d, s] = padded
                back[d, heads] = s * rows + np.arange(len(heads))
        return cls(gather, back, rows)


def gqa_decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, plan: UnitPlan, scale: float, *, tiling=None
) -> jax.Array:
    """One decode token of GQA on the kernel: q [B, 1, h, D] (split over `tensor` by heads under TP), k and v
    [B, S, stored, D] laid out by `plan`, mask [B, 1, S] (kv_cache.slot_mask: a contiguous range per sequence)
    -> [B, 1, h, D]. Every mesh axis still automatic here is made manual: sequences split over the data axes,
    heads and stored KV heads over `tensor`. `tiling`: the kernel's (gqa_decode_gpu.Tiling; None: its default)."""
    starts, ends = ranges_from_mask(mask)
    table = HeadTable.of(plan, plan.per_device)
    run = kernel(tiling)

    def on_device(q, k, v, starts, ends):
        b, _, h, d = q.shape
        slots = k.shape[2]
        if table.gather is None:
            grouped = q.reshape(b, slots, h // slots, d)
        else:
            device = jax.lax.axis_index(TENSOR) if plan.tp > 1 else 0
            gather = jnp.asarray(table.gather)[device].reshape(-1)
            grouped = jnp.take(q[:, 0], gather, axis=1).reshape(b, slots, table.rows, d)
        out = run(grouped, k, v, starts, ends, scale=scale)
        if table.gather is None:
            return out.reshape(b, 1, h, d)
        back = jnp.asarray(table.back)[device]
        return jnp.take(out.reshape(b, -1, d), back, axis=1)[:, None]

    auto = automatic_axes()
    if not auto:
        return on_device(q, k, v, starts, ends)
    batch = split_batch_axes(q.shape[0]) or None  # undivided: every device attends for all sequences
    heads = TENSOR if TENSOR in auto and plan.tp > 1 else None
    spread = P(batch, None, heads, None)
    return jax.shard_map(
        on_device,
        in_specs=(spread, spread, spread, P(batch), P(batch)),
        out_specs=spread,
        axis_names=set(auto),
        check_vma=False,
    )(q, k, v, starts, ends)
