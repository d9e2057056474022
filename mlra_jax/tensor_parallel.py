"""Tensor parallelism over the mesh's `tensor` axis.

Every cached tensor has `units` interchangeable slices (KV heads, latent blocks; see
attention.base.CacheComponent). At TP degree t a tensor of `units` slices is
  * split:      units % t == 0 -> each device stores units / t slices;
  * expanded:   t % units == 0 -> the tensor is stored with t slices, device d keeping a
                copy of slice d // (t / units): each device loads one slice, as in paper
                Table 1 (MLRA at TP=8 keeps 1.5 d_h per device, GLA-2 at TP=4 2.5 d_h);
  * aligned:    KV heads whose count TP neither divides nor is a multiple of, read by query heads
                that TP divides (GQA's 6 KV heads of 24 query heads at TP=4): device d stores the
                KV heads its own query heads read (2 of the 6), laid out as `tp * k` slots;
  * replicated: otherwise (one slice, or a degree that fits neither way; every device
                keeps them all, which `info` reports).

The latent family (MLA, GLA, MLRA) runs its attention in `jax.shard_map` over
`tensor` (attention/latent.py); `LatentPlan` says which latent block(s) and heads
device d serves. Where devices outnumber blocks, the devices sharing a block split its
heads. MLA (one block) is the FlashMLA scheme: heads split, latent replicated. Other
variants use GSPMD through the logical axis rules (sharding.py): heads and KV heads
split as far as they divide.
"""

from __future__ import annotations

import dataclasses
import logging

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
    """How a tensor of `units` slices along one axis is stored under TP degree `tp`; `heads` query heads read the
    slices (head i reads slice i // (heads / units); 0 when no query heads map onto them)."""

    units: int
    tp: int
    heads: int = 0

    @property
    def expanded(self) -> bool:
        return 1 < self.units < self.tp and self.tp % self.units == 0

    @property
    def aligned(self) -> bool:
        """Slices that TP neither divides nor spreads, stored per device as its query heads read them."""
        return (
            self.tp > 1
            and self.units > 1
            and not self.expanded
            and self.units % self.tp != 0
            and self.heads % self.units == 0
            and self.heads % self.tp == 0
        )

    @property
    def sharded(self) -> bool:
        return self.tp > 1 and (self.expanded or self.aligned or (self.units > 1 and self.units % self.tp == 0))

    @property
    def replicated_fallback(self) -> bool:
        """Several slices that this degree can neither split nor spread: every device keeps them all."""
        return self.tp > 1 and self.units > 1 and not self.sharded

    @property
    def stored(self) -> int:
        """Slices along the stored axis (tp when expanded, tp times the slices a device reads when aligned)."""
        if self.aligned:
            return self.tp * self.device_units.shape[1]
        return self.tp if self.expanded else self.units

    @property
    def device_units(self) -> np.ndarray:
        """[tp, k]: the slices device d's query heads read (aligned plans), in order, the last repeated to k."""
        per_device, group = self.heads // self.tp, self.heads // self.units
        needed = [sorted({h // group for h in range(d * per_device, (d + 1) * per_device)}) for d in range(self.tp)]
        k = max(map(len, needed))
        return np.array([units + units[-1:] * (k - len(units)) for units in needed])

    @property
    def local_heads_slot(self) -> np.ndarray:
        """[tp, heads / tp]: the local slot (of the k that device d stores) each of its query heads reads."""
        per_device, group = self.heads // self.tp, self.heads // self.units
        table = self.device_units
        return np.array(
            [
                [int(np.argmax(table[d] == h // group)) for h in range(d * per_device, (d + 1) * per_device)]
                for d in range(self.tp)
            ]
        )

    @property
    def per_device(self) -> int:
        """Slices each device stores (and loads per token)."""
        return self.stored // self.tp if self.sharded else self.stored

    @property
    def unit_index(self) -> np.ndarray:
        """Logical slice held at each stored position."""
        if self.aligned:
            return self.device_units.reshape(-1)
        return np.arange(self.stored) * self.units // self.stored

    def store(self, x: jax.Array, axis: int) -> jax.Array:
        """Lay x (units slices along `axis`) out for storage: expanded or aligned copies where planned."""
        return jnp.take(x, jnp.asarray(self.unit_index), axis=axis) if self.expanded or self.aligned else x

    def spec(self, ndim: int, axis: int, leading: tuple = ()) -> P:
        """PartitionSpec of a stored array: `tensor` on the slice axis when sharded."""
        entries = list(leading) + [None] * (ndim - len(leading))
        if self.sharded:
            entries[axis] = TENSOR
        return P(*entries)


def unit_plan(units: int, tp: int, heads: int = 0) -> UnitPlan:
    plan = UnitPlan(units, tp, heads)
    if plan.replicated_fallback:
        log.warning(
            "%d slices cannot be divided over TP=%d devices (nor TP over them): replicated on every device", units, tp
        )
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
            raise ConfigError(
                f"TP={t} cannot split {b} latent blocks: use a TP degree that divides {b} or is a multiple of it"
            )
        if self.block_heads % self.head_split:
            raise ConfigError(
                f"TP={t} puts {self.head_split} devices on each latent block, but its "
                f"{self.block_heads} heads do not divide among them; use a TP degree with "
                f"{self.block_heads} % (TP / {b}) == 0"
            )

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

    @property
    def serves_every_head(self) -> bool:
        """Whether every device's blocks serve all heads (MLRA-4 up to TP=4, MLRA-2 at TP=2): each device's branch
        sums are then a full partial of the heads' output, which a whole output projection turns into a partial
        of the hidden state (one all-reduce per attention, as a row-parallel layer)."""
        return self.head_split == 1 and self.local_blocks >= self.blocks // self.branches

    def first_block(self, device: jax.Array) -> jax.Array:
        return device * self.blocks // self.tp if self.blocks >= self.tp else device // self.head_split

    def head_slice(self, device: jax.Array) -> tuple[jax.Array, int]:
        width = self.block_heads // self.head_split
        return (device % self.head_split) * width, width


# The dtype in which decode steps reduce the latent branches' partial sums over `tensor`: "compute" (bfloat16 in
# serving: half the bytes of float32 on the wire) or "float32". Training and prefill always reduce in float32.
DECODE_REDUCE_DTYPE = "compute"


def reduce_dtype(mode: str, compute_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype of the partial sums that a region of `mode` ("train", "prefill", "decode") reduces over `tensor`."""
    return compute_dtype if mode == "decode" and DECODE_REDUCE_DTYPE == "compute" else jnp.float32


# XLA's CPU compiler crashes on bfloat16 cotangents psum-ed in partially manual shard_maps (jax 0.10): in training
# the replicated inputs of the latent region enter in float32, so that their cotangents' psum is float32. Kept
# on every version this package supports (jax < 0.12); check again before raising that bound.
WIDEN_REPLICATED_TRAINING_INPUTS = jax.__version_info__ < (0, 12)


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """How the latent blocks' shard_map over `tensor` is laid out in one mode: the specs of its inputs and output,
    the mesh axes it makes manual, and which operands it splits by heads rather than by blocks."""

    queries: P
    stored_kv: tuple[P, P]  # the latent as planned, the one RoPE key replicated over tensor
    kv_up: P
    mask: P
    out: P
    manual_axes: frozenset[str]
    heads_sharded_in: bool  # one branch: device d serves exactly head shard d
    kv_up_by_heads: bool  # kv_up split over its head axis (MLA's replicated block), not its block axis
    widen_replicated: bool  # replicated floating inputs enter in float32

    def widen(self, x: jax.Array, spec: P) -> jax.Array:
        """x in float32 when this layout widens replicated inputs and `spec` replicates x."""
        replicated = all(entry is None for entry in spec)
        if self.widen_replicated and replicated and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(jnp.float32)
        return x


def _region_layout(
    plan: LatentPlan, lead: tuple, manual: frozenset[str], widen: bool, has_mask: bool, ndims: tuple[int, int]
) -> RegionLayout:
    """The layout for a batch spec `lead` (its first entry), `manual` axes, of a latent and a kv_up of `ndims`."""
    latent_ndim, kv_up_ndim = ndims
    heads_sharded_in = plan.branches == 1
    kv_up_by_heads = not plan.units.sharded and plan.block_heads % plan.tp == 0
    return RegionLayout(
        queries=P(*lead, None, TENSOR, None) if heads_sharded_in else P(*lead),
        stored_kv=(plan.units.spec(latent_ndim, 2, leading=lead), P(*lead)),
        kv_up=P(None, None, TENSOR, None) if kv_up_by_heads else plan.units.spec(kv_up_ndim, 0),
        mask=P(*lead) if has_mask else P(),
        out=P(*lead, None, TENSOR, None) if heads_sharded_in or plan.heads % plan.tp == 0 else P(*lead),
        manual_axes=manual,
        heads_sharded_in=heads_sharded_in,
        kv_up_by_heads=kv_up_by_heads,
        widen_replicated=widen,
    )


def train_layout(plan: LatentPlan, has_mask: bool, ndims: tuple[int, int]) -> RegionLayout:
    """Training: only `tensor` is manual (data and fsdp stay with GSPMD); replicated inputs widened."""
    return _region_layout(plan, (None,), frozenset({TENSOR}), WIDEN_REPLICATED_TRAINING_INPUTS, has_mask, ndims)


def prefill_layout(plan: LatentPlan, has_mask: bool, ndims: tuple[int, int]) -> RegionLayout:
    """A prefill chunk over the cache: only `tensor` is manual, inputs as they come."""
    return _region_layout(plan, (None,), frozenset({TENSOR}), False, has_mask, ndims)


def decode_layout(
    plan: LatentPlan, has_mask: bool, ndims: tuple[int, int], batch_axes: tuple[str, ...], automatic: frozenset[str]
) -> RegionLayout:
    """A decode step: every automatic axis manual (a kernel under partly automatic axes fails to compile on GPUs, and
    XLA's CPU compiler crashes on bfloat16 reductions in them), the batch split over `batch_axes` where it divides
    (the Pallas kernel inside runs on each device's own sequences), else whole on every device."""
    return _region_layout(plan, (batch_axes or None,), automatic, False, has_mask, ndims)


def per_device_bytes(array: jax.Array) -> int:
    """Bytes of the largest shard one device holds of a (sharded) array."""
    return max(shard.data.nbytes for shard in array.addressable_shards)
