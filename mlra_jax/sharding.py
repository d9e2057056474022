"""The device mesh and the one table that maps logical axes onto it.

Parameters carry logical axis names (layers.make_param); `LOGICAL_RULES` says which
mesh axes each may be split over. A dimension is split only where the mesh axes
divide it and no other dimension of the same array already uses them, so every
rule is safe for any shape (a dimension that cannot be split stays replicated).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mlra_jax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes it may be split over, in order of preference
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "mlp": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "latent_blocks": ("tensor",),
    "block_heads": ("tensor",),
}


def mesh_shape(cfg: MeshConfig, device_count: int) -> tuple[int, int, int]:
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if device_count % known:
            raise ConfigError(
                f"mesh {dict(zip(MESH_AXES, sizes))}: {device_count} devices are not divisible by "
                f"{known}; choose mesh sizes whose product divides the device count"
            )
        sizes[sizes.index(-1)] = device_count // known
    if math.prod(sizes) != device_count:
        raise ConfigError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but "
            f"{device_count} are available; set one axis to -1 to use the rest"
        )
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with automatic (GSPMD) sharding propagation."""
    devices = devices if devices is not None else jax.devices()
    shape = mesh_shape(cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(
    axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, fsdp_everything: bool = True
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes, under LOGICAL_RULES.

    With `fsdp_everything` (parameters and optimizer state), an array that the rules
    leave unsplit over 'fsdp' is split over it along its largest dimension that
    divides, so that FSDP stores 1/fsdp of every tensor (ZeRO-3)."""
    used: set[str] = set()
    chosen: list[list[str]] = []
    for name, size in zip(axes, shape):
        picked: list[str] = []
        for mesh_axis in LOGICAL_RULES.get(name, ()):
            n = mesh.shape[mesh_axis]
            if n > 1 and mesh_axis not in used and size % (math.prod(mesh.shape[a] for a in picked) * n) == 0:
                picked.append(mesh_axis)
        used.update(picked)
        chosen.append(picked)
    fsdp = mesh.shape["fsdp"]
    if fsdp_everything and fsdp > 1 and "fsdp" not in used:
        sizes = [size // math.prod(mesh.shape[a] for a in picked) for size, picked in zip(shape, chosen)]
        fits = [i for i, size in enumerate(sizes) if size % fsdp == 0]
        if fits:
            chosen[max(fits, key=lambda i: sizes[i])].append("fsdp")
    return PartitionSpec(*(None if not p else p[0] if len(p) == 1 else tuple(p) for p in chosen))


def tree_shardings(
    tree: Mapping[str, Any], axes: Mapping[str, tuple[str | None, ...]], mesh: Mesh, prefix: str = ""
) -> dict[str, Any]:
    """NamedShardings for a nested dict of arrays whose dotted paths index `axes`."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out[key] = tree_shardings(value, axes, mesh, path + ".")
        else:
            out[key] = NamedSharding(mesh, logical_to_spec(axes[path], value.shape, mesh))
    return out


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sequences split over every data-parallel axis."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def constrain_batch(x: jax.Array) -> jax.Array:
    """x with its leading (batch) axis split over the data-parallel axes of the mesh in context and its other axes
    whole on each device, where the batch divides; else x as it is. Activations need saying so: GSPMD would
    otherwise follow the FSDP-sharded weights (the embedding's d over fsdp) and split d instead, leaving every
    device with a slice of every sequence (on a v5p-64 FSDP mesh: 17 times the activation memory per chip)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    auto = {
        name: size
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
        if kind != AxisType.Manual
    }
    axes = tuple(a for a in ("data", "fsdp") if auto.get(a, 1) > 1)
    if not axes or x.shape[0] % math.prod(auto[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes, *([None] * (x.ndim - 1))))


def without_axis(sharding: NamedSharding, axis: str) -> NamedSharding:
    """`sharding` whole along mesh axis `axis` (dropped from its spec), split as before over the others."""

    def drop(entry: Any) -> Any:
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != axis)
        return kept[0] if len(kept) == 1 else kept or None

    return NamedSharding(sharding.mesh, PartitionSpec(*map(drop, sharding.spec)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def bytes_per_device(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of a tree of (abstract) arrays under these shardings (the largest shard)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def automatic_axes() -> dict[str, int]:
    """The mesh axes still under GSPMD here (name -> size); empty outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return {}
    return {
        name: size
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
        if kind != AxisType.Manual
    }


def split_batch_axes(batch: int) -> tuple[str, ...]:
    """The automatic data-parallel axes (size > 1) over which a batch of `batch` sequences splits evenly;
    () when there are none or the batch does not divide."""
    auto = automatic_axes()
    axes = tuple(a for a in LOGICAL_RULES["batch"] if auto.get(a, 1) > 1)
    return axes if axes and batch % math.prod(auto[a] for a in axes) == 0 else ()
