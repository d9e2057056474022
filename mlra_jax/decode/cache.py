"""The decode cache: what each variant caches, preallocated to a maximum length.

`DecodeState.kv[name]` is [n_layer, B, max_len, stored_units, *unit_shape] per cached
component (attention.base.CacheComponent), laid out for the TP degree of the mesh in
context (tensor_parallel.UnitPlan). Sequences are left-padded: sequence b's tokens sit
in slots starts[b] .. index-1, and the token in slot s has position s - starts[b], so
every sequence counts positions from its own first token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from mlra_jax.analysis import cache_layout
from mlra_jax.config import ModelConfig
from mlra_jax.tensor_parallel import UnitPlan, tensor_size, unit_plan


class DecodeState(NamedTuple):
    kv: dict[str, jax.Array]
    starts: jax.Array  # [B] int32: first real slot of each sequence (left padding before it)
    index: jax.Array  # int32 scalar: the next slot to write (the same for every sequence)

    @property
    def max_len(self) -> int:
        return next(iter(self.kv.values())).shape[2]

    @property
    def lengths(self) -> jax.Array:
        """Real tokens cached per sequence."""
        return self.index - self.starts


def cache_plans(cfg: ModelConfig, tp: int | None = None) -> dict[str, UnitPlan]:
    tp = tensor_size() if tp is None else tp
    return {c.name: unit_plan(c.units, tp) for c in cache_layout(cfg)}


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, tp: int | None = None) -> dict[str, tuple[int, ...]]:
    plans = cache_plans(cfg, tp)
    return {c.name: (cfg.n_layer, batch, max_len, plans[c.name].stored, *c.unit_shape) for c in cache_layout(cfg)}


def cache_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...] = ("data", "fsdp")
                    ) -> dict[str, NamedSharding]:
    """Slices split over `tensor` as planned, sequences over the data-parallel axes."""
    plans = cache_plans(cfg, mesh.shape.get("tensor", 1))
    batch_axes = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1) or None
    return {c.name: NamedSharding(mesh, plans[c.name].spec(4 + len(c.unit_shape), 3, leading=(None, batch_axes)))
            for c in cache_layout(cfg)}


SLOT_MULTIPLE = 8  # caches hold a multiple of 8 slots (TMA tiles rows in 8s in the GPU decode kernel)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, starts: jax.Array | None = None,
               mesh: jax.sharding.Mesh | None = None) -> DecodeState:
    """An empty cache of at least `max_len` slots (rounded up to SLOT_MULTIPLE) in the compute
    dtype; sharded over `mesh` when given."""
    max_len = -(-max_len // SLOT_MULTIPLE) * SLOT_MULTIPLE
    tp = mesh.shape.get("tensor", 1) if mesh is not None else None
    shapes = cache_shapes(cfg, batch, max_len, tp)
    kv = {name: jnp.zeros(shape, cfg.dtype) for name, shape in shapes.items()}
    if mesh is not None:
        kv = jax.device_put(kv, cache_shardings(cfg, mesh))
    starts = jnp.zeros((batch,), jnp.int32) if starts is None else jnp.asarray(starts, jnp.int32)
    return DecodeState(kv, starts, jnp.zeros((), jnp.int32))


def slot_mask(state: DecodeState, length: int) -> tuple[jax.Array, jax.Array]:
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
    from mlra_jax.config import MeshConfig
    from mlra_jax.sharding import make_mesh
    from mlra_jax.tensor_parallel import per_device_bytes

    devices = (devices or jax.devices())[:tp]
    if len(devices) < tp:
        raise ValueError(f"measuring TP={tp} needs {tp} devices, {len(devices)} are present (on a CPU, set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={tp})")
    state = init_cache(cfg, batch=1, max_len=2, mesh=make_mesh(MeshConfig(data=1, tensor=tp), devices))
    return sum(per_device_bytes(a) for a in state.kv.values()) // (cfg.n_layer * state.max_len)
