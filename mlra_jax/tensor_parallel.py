"""Tensor parallelism over the mesh's `tensor` axis.

Every cached tensor has `units` interchangeable slices (KV heads, latent blocks; see
attention.base.CacheComponent). At TP degree t a tensor of `units` slices is
  * split:      units % t == 0 -> each device stores units / t slices;
  * expanded:   t % units == 0 -> the tensor is stored with t slices, device d keeping a
                copy of slice d // (t / units): each device loads one slice, as in paper
                Table 1 (MLRA at TP=8 keeps 1.5 d_h per device, GLA-2 at TP=4 2.5 d_h);
  * replicated: otherwise (one slice, or a degree that fits neither way; every device
                keeps them all, which `info` reports).

The latent family (MLA, GLA, MLRA) runs its attention in `jax.shard_map` over
`tensor` (data and fsdp stay automatic): device d owns its latent block(s), their
RMSNorm and kv_up slices and its cache slice, attends from the heads it serves
(absorbed when decoding) and the branch outputs meet in one psum_scatter that leaves
the heads split for the row-parallel output projection. Where devices outnumber
blocks, the devices sharing a block split its heads. MLA (one block) is the FlashMLA
scheme: heads split, latent replicated. Other variants use GSPMD through the logical
axis rules (sharding.py): heads and KV heads split as far as they divide.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mlra_jax.config import ConfigError

TENSOR = "tensor"
log = logging.getLogger(__name__)


def tensor_size() -> int:
    """The TP degree of the mesh in context (jax.set_mesh), 1 outside any mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or TENSOR not in mesh.axis_names else mesh.shape[TENSOR]


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """How a tensor of `units` slices along one axis is stored under TP degree `tp`."""

    units: int
    tp: int

    @property
    def expanded(self) -> bool:
        return 1 < self.units < self.tp and self.tp % self.units == 0

    @property
    def sharded(self) -> bool:
        return self.tp > 1 and (self.expanded or (self.units > 1 and self.units % self.tp == 0))

    @property
    def replicated_fallback(self) -> bool:
        """Several slices that this degree can neither split nor spread: every device keeps them all."""
        return self.tp > 1 and self.units > 1 and not self.sharded

    @property
    def stored(self) -> int:
        """Slices along the stored axis (tp when expanded)."""
        return self.tp if self.expanded else self.units

    @property
    def per_device(self) -> int:
        """Slices each device stores (and loads per token)."""
        return self.stored // self.tp if self.sharded else self.stored

    @property
    def unit_index(self) -> np.ndarray:
        """Logical slice held at each stored position."""
        return np.arange(self.stored) * self.units // self.stored

    def store(self, x: jax.Array, axis: int) -> jax.Array:
        """Lay x (units slices along `axis`) out for storage: expanded copies where planned."""
        return jnp.take(x, jnp.asarray(self.unit_index), axis=axis) if self.expanded else x

    def spec(self, ndim: int, axis: int, leading: tuple = ()) -> P:
        """PartitionSpec of a stored array: `tensor` on the slice axis when sharded."""
        entries = list(leading) + [None] * (ndim - len(leading))
        if self.sharded:
            entries[axis] = TENSOR
        return P(*entries)


def unit_plan(units: int, tp: int) -> UnitPlan:
    plan = UnitPlan(units, tp)
    if plan.replicated_fallback:
        log.warning("%d slices cannot be divided over TP=%d devices (nor TP over them): replicated on every "
                    "device", units, tp)
    return plan


@dataclasses.dataclass(frozen=True)
class LatentPlan:
    """Which latent blocks and heads device d of a TP group serves (latent family)."""

    blocks: int
    branches: int
    heads: int
    tp: int

    def __post_init__(self) -> None:
        b, t = self.blocks, self.tp
        if not (b % t == 0 or t % b == 0):
            raise ConfigError(f"TP={t} cannot split {b} latent blocks: use a TP degree that divides {b} or is a "
                              f"multiple of it")
        if self.block_heads % self.head_split:
            raise ConfigError(f"TP={t} puts {self.head_split} devices on each latent block, but its "
                              f"{self.block_heads} heads do not divide among them; use a TP degree with "
                              f"{self.block_heads} % (TP / {b}) == 0")

    @property
    def block_heads(self) -> int:
        return self.heads * self.branches // self.blocks

    @property
    def units(self) -> UnitPlan:
        return UnitPlan(self.blocks, self.tp)

    @property
    def head_split(self) -> int:
        """Devices that share one block, each serving a slice of its heads."""
        return max(1, self.tp // self.blocks)

    @property
    def local_blocks(self) -> int:
        return max(1, self.blocks // self.tp)

    def first_block(self, device: jax.Array) -> jax.Array:
        return device * self.blocks // self.tp if self.blocks >= self.tp else device // self.head_split

    def head_slice(self, device: jax.Array) -> tuple[jax.Array, int]:
        width = self.block_heads // self.head_split
        return (device % self.head_split) * width, width


def latent_region(plan: LatentPlan, local_fn: Callable[..., jax.Array], queries: tuple[jax.Array, ...],
                  stored_kv: tuple[jax.Array, ...], kv_axes: tuple[int, ...], kv_up: jax.Array,
                  mask: jax.Array | None, per_block: Callable[[jax.Array], jax.Array], branch_scale: float,
                  out_dtype: jnp.dtype, differentiable: bool = True) -> jax.Array:
    """Run `local_fn` on each device's latent blocks and heads; return [B, T, h, d_h] split over heads.

    queries: [B, T, h, D] arrays; stored_kv: cache-layout arrays whose slice axes are `kv_axes`;
    kv_up: [blocks, rank, block_heads, 2 d_h]; per_block: [B, T, h, D] -> [B, T, blocks, block_heads, D].
    local_fn(*queries_local, *kv_local, kv_up_local, mask) -> [B, T, local_blocks, local_heads, d_h].
    differentiable: replicated inputs enter in float32, so that the psum of their cotangents is
    float32 (XLA's CPU compiler crashes on bfloat16 ones in partially manual shard_maps, jax 0.10);
    decoding passes False and keeps its cache in the compute dtype.
    """
    units, h, t = plan.units, plan.heads, plan.tp
    heads_sharded_in = plan.branches == 1  # device d serves exactly head shard d
    # kv_up: the block axis split like the cache, or (MLA) the head axis split when blocks are replicated
    kv_up_by_heads = not units.sharded and plan.block_heads % t == 0
    kv_up = units.store(kv_up, axis=0)
    kv_up_spec = P(None, None, TENSOR, None) if kv_up_by_heads else units.spec(kv_up.ndim, 0)

    def body(queries, stored_kv, kv_up, mask):
        queries = tuple(x.astype(out_dtype) for x in queries)
        stored_kv = tuple(x.astype(out_dtype) for x in stored_kv)
        device = jax.lax.axis_index(TENSOR)
        first = plan.first_block(device)
        head_start, width = plan.head_slice(device)

        def mine(x: jax.Array) -> jax.Array:  # this device's [B, T, local_blocks, width, D]
            if heads_sharded_in:
                return x.reshape(x.shape[:2] + (plan.local_blocks, width, x.shape[-1]))
            blocks = jax.lax.dynamic_slice_in_dim(per_block(x), first, plan.local_blocks, axis=2)
            return jax.lax.dynamic_slice_in_dim(blocks, head_start, width, axis=3)

        up = kv_up if kv_up_by_heads else jax.lax.dynamic_slice_in_dim(kv_up, head_start, width, axis=2)
        out = local_fn(*map(mine, queries), *stored_kv, up, mask).astype(jnp.float32)
        if heads_sharded_in:
            return out.reshape(out.shape[:2] + (-1, out.shape[-1])).astype(out_dtype)
        groups = plan.blocks // plan.branches
        full = jnp.zeros(out.shape[:2] + (h, out.shape[-1]), jnp.float32)
        for j in range(plan.local_blocks):  # add each local block's heads into their place among all heads
            start = ((first + j) % groups) * plan.block_heads + head_start
            current = jax.lax.dynamic_slice_in_dim(full, start, width, axis=2)
            full = jax.lax.dynamic_update_slice_in_dim(full, current + out[:, :, j], start, axis=2)
        full = full * branch_scale
        if h % t == 0:
            return jax.lax.psum_scatter(full, TENSOR, scatter_dimension=2, tiled=True).astype(out_dtype)
        return jax.lax.psum(full, TENSOR).astype(out_dtype)

    q_spec = P(None, None, TENSOR, None) if heads_sharded_in else P()
    kv_specs = tuple(units.spec(x.ndim, axis) if x.shape[axis] == units.stored else P()
                     for x, axis in zip(stored_kv, kv_axes))
    if differentiable:
        widen = lambda x, spec: (x.astype(jnp.float32) if all(e is None for e in spec)
                                 and jnp.issubdtype(x.dtype, jnp.floating) else x)
        queries = tuple(widen(x, q_spec) for x in queries)
        stored_kv = tuple(widen(x, spec) for x, spec in zip(stored_kv, kv_specs))
    out_spec = P(None, None, TENSOR, None) if heads_sharded_in or h % t == 0 else P()
    mapped = jax.shard_map(body, in_specs=(q_spec, kv_specs, kv_up_spec, P()), out_specs=out_spec,
                           axis_names={TENSOR}, check_vma=False)
    return mapped(queries, stored_kv, kv_up, mask)


def per_device_bytes(array: jax.Array) -> int:
    """Bytes of the largest shard one device holds of a (sharded) array."""
    return max(shard.data.nbytes for shard in array.addressable_shards)
