"""The decode cache: what each variant caches, preallocated to a maximum length.

`DecodeState.kv[name]` is [n_layer, B, max_len, stored_units, *unit_shape] per cached
component (attention.base.CacheComponent), laid out for a TP degree as `DecodeState.plans`
say (tensor_parallel.UnitPlan; fixed when the cache is made, static under jit). Sequences
are left-padded: sequence b's tokens sit in slots starts[b] .. index-1, and the token in
slot s has position s - starts[b], so every sequence counts positions from its own first token.

The model writes and reads this state (model.Transformer.forward_cached); decoding
(mlra_jax.decode) makes it. It sits below both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from mlra_jax.cache_accounting import cache_layout
from mlra_jax.config import MeshConfig, ModelConfig
from mlra_jax.sharding import make_mesh
from mlra_jax.tensor_parallel import UnitPlan, per_device_bytes, tensor_size, unit_plan

CachePlans = tuple[tuple[str, UnitPlan], ...]  # (cached tensor, its layout over the tensor axis); hashable


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kv", "starts", "index"], meta_fields=["plans"])
@dataclasses.dataclass(frozen=True)
class DecodeState:
    kv: dict[str, jax.Array]
    starts: jax.Array  # [B] int32: first real slot of each sequence (left padding before it)
    index: jax.Array  # int32 scalar: the next slot to write (the same for every sequence)
    plans: CachePlans  # how each cached tensor is stored over the tensor axis (static)

    @property
    def max_len(self) -> int:
        return next(iter(self.kv.values())).shape[2]

    @property
    def lengths(self) -> jax.Array:
        """Real tokens cached per sequence."""
        return self.index - self.starts


def cache_plans(cfg: ModelConfig, tp: int | None = None) -> dict[str, UnitPlan]:
    """The storage plan of each cached tensor at TP degree `tp` (default: the mesh in context)."""
    tp = tensor_size() if tp is None else tp
    return {c.name: unit_plan(c.units, tp, c.read_by_heads) for c in cache_layout(cfg)}


def cache_shardings(
    cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...] = ("data", "fsdp")
) -> dict[str, NamedSharding]:
    """Slices split over `tensor` as planned, sequences over the data-parallel axes."""
    plans = cache_plans(cfg, mesh.shape.get("tensor", 1))
    batch_axes = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1) or None
    return {
        c.name: NamedSharding(mesh, plans[c.name].spec(4 + len(c.unit_shape), 3, leading=(None, batch_axes)))
        for c in cache_layout(cfg)
    }


SLOT_MULTIPLE = 8  # caches hold a multiple of 8 slots (TMA tiles rows in 8s in the GPU decode kernel)


def _zeros(shapes: Any, shardings: Any = None) -> Any:
    """Zero arrays of a tree of ShapeDtypeStructs, made by one jitted call in `shardings` (a tree of the same
    structure) when given: no host copy, and a mesh may span processes."""
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), out_shardings=shardings)()


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, starts: jax.Array | None = None, mesh: jax.sharding.Mesh | None = None
) -> DecodeState:
    """An empty cache of at least `max_len` slots (rounded up to SLOT_MULTIPLE) in the compute
    dtype; sharded over `mesh` when given."""
    max_len = -(-max_len // SLOT_MULTIPLE) * SLOT_MULTIPLE
    tp = mesh.shape.get("tensor", 1) if mesh is not None else None
    plans = cache_plans(cfg, tp)
    shapes = {
        c.name: jax.ShapeDtypeStruct((cfg.n_layer, batch, max_len, plans[c.name].stored, *c.unit_shape), cfg.dtype)
        for c in cache_layout(cfg)
    }
    kv = _zeros(shapes, cache_shardings(cfg, mesh) if mesh is not None else None)
    starts = jnp.zeros((batch,), jnp.int32) if starts is None else jnp.asarray(starts, jnp.int32)
    return DecodeState(kv, starts, jnp.zeros((), jnp.int32), tuple(plans.items()))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers", "starts", "index"], meta_fields=["plans"])
@dataclasses.dataclass(frozen=True)
class LayerCaches:
    """The serving form of the cache (decode.serving): one buffer per layer and cached tensor,
    layers[l][name] [B, capacity, stored_units, *unit_shape], so that a jitted step given them donated
    updates each in place (a stacked [n_layer, ...] array threaded through a layer scan is re-emitted,
    copied whole, every step). Slots, starts and index mean what they mean in DecodeState."""

    layers: tuple[dict[str, jax.Array], ...]
    starts: jax.Array
    index: jax.Array
    plans: CachePlans

    @property
    def max_len(self) -> int:
        """Slots per sequence (the capacity: the attended range is masked within it)."""
        return next(iter(self.layers[0].values())).shape[1]

    @property
    def lengths(self) -> jax.Array:
        return self.index - self.starts

    def stacked(self) -> DecodeState:
        """The same cache as a DecodeState (a copy; for tests and inspection)."""
        kv = {name: jnp.stack([layer[name] for layer in self.layers]) for name in self.layers[0]}
        return DecodeState(kv, self.starts, self.index, self.plans)


def layer_cache_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> dict[str, NamedSharding]:
    """cache_shardings without the layer axis: one layer's buffers."""
    return {
        name: NamedSharding(mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        for name, sharding in cache_shardings(cfg, mesh).items()
    }


def init_layer_caches(
    cfg: ModelConfig, batch: int, capacity: int, starts: jax.Array | None = None, mesh: jax.sharding.Mesh | None = None
) -> LayerCaches:
    """Empty per-layer caches of `capacity` slots (a multiple of SLOT_MULTIPLE) in the compute dtype,
    created directly in their shardings under `mesh`."""
    if capacity % SLOT_MULTIPLE:
        raise ValueError(f"a cache capacity of {capacity} slots is not a multiple of {SLOT_MULTIPLE}")
    tp = mesh.shape.get("tensor", 1) if mesh is not None else None
    plans = cache_plans(cfg, tp)
    layer = {
        c.name: jax.ShapeDtypeStruct((batch, capacity, plans[c.name].stored, *c.unit_shape), cfg.dtype)
        for c in cache_layout(cfg)
    }
    shardings = (layer_cache_shardings(cfg, mesh),) * cfg.n_layer if mesh is not None else None
    layers = _zeros((layer,) * cfg.n_layer, shardings)
    starts = jnp.zeros((batch,), jnp.int32) if starts is None else jnp.asarray(starts, jnp.int32)
    return LayerCaches(layers, starts, jnp.zeros((), jnp.int32), tuple(plans.items()))


def slot_mask(state: DecodeState | LayerCaches, length: int) -> tuple[jax.Array, jax.Array]:
    """(positions [B, T], mask [B, T, max_len]) for `length` new tokens written at state.index."""
    slots = state.index + jnp.arange(length, dtype=jnp.int32)
    positions = slots[None, :] - state.starts[:, None]
    keys = jnp.arange(state.max_len, dtype=jnp.int32)
    valid = keys[None, :] >= state.starts[:, None]
    mask = valid[:, None, :] & (keys[None, None, :] <= slots[None, :, None])
    return positions, mask


def measured_kv_bytes_per_token(cfg: ModelConfig, tp: int, devices: list[jax.Device] | None = None) -> int:
    """Cache bytes per token per layer that one device stores (and loads per decode step) at TP=tp,
    measured on a real sharded cache over `tp` devices (not computed from a formula)."""
    devices = (devices or jax.devices())[:tp]
    if len(devices) < tp:
        raise ValueError(
            f"measuring TP={tp} needs {tp} devices, {len(devices)} are present (on a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp})"
        )
    state = init_cache(cfg, batch=1, max_len=2, mesh=make_mesh(MeshConfig(data=1, tensor=tp), devices))
    return sum(per_device_bytes(a) for a in state.kv.values()) // (cfg.n_layer * state.max_len)
