"""Flat, dotted views of a model's parameters ("blocks.attn.q_up" -> array)."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx


def _walk(tree: Mapping[str, Any], prefix: str = ""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _walk(value, path + ".")
        else:
            yield path, value


def flatten(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dict -> {dotted path: leaf}."""
    return dict(_walk(tree))


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def flat_params(model: nnx.Module) -> dict[str, jax.Array]:
    """The model's parameters (arrays or ShapeDtypeStructs) under dotted paths."""
    return flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def logical_axes(model: nnx.Module) -> dict[str, tuple[str | None, ...]]:
    """Each parameter's logical axis names; stacked layers gain a leading 'layers' axis."""
    state = nnx.state(model, nnx.Param)
    axes = {}
    for path, var in nnx.to_flat_state(state):
        names = tuple(var.get_metadata().get("logical_axes", ()))
        if len(names) == len(var.get_value().shape) - 1:
            names = ("layers",) + names
        axes[".".join(map(str, path))] = names
    return axes


def set_flat_params(model: nnx.Module, flat: Mapping[str, Any]) -> None:
    """Replace every parameter of `model` from `flat` (same paths, same shapes)."""
    state = nnx.state(model, nnx.Param)
    current = flat_params(model)
    if set(current) != set(flat):
        raise KeyError(
            f"parameter paths differ: missing {sorted(set(current) - set(flat))[:5]}, "
            f"unexpected {sorted(set(flat) - set(current))[:5]}"
        )
    pure = unflatten({p: jnp.asarray(flat[p], dtype=current[p].dtype) for p in current})
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def compute_params(params: dict[str, Any], dtype: jnp.dtype) -> dict[str, Any]:
    """Weights cast once to the compute dtype, before any layer reads them, so that FSDP all-gathers
    them in it (the layers would cast each one after its gather). Norm scales stay float32, and so
    does the embedding, whose lookup feeds the float32 residual stream; numerics are unchanged."""

    def cast(path: tuple, leaf: jax.Array) -> jax.Array:
        names = [str(getattr(key, "key", key)) for key in path]
        keep = (
            names[-1] == "scale" or names[-2:] == ["embed", "embedding"] or not jnp.issubdtype(leaf.dtype, jnp.floating)
        )
        return leaf if keep else leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def params_for_compute(params: dict[str, Any], dtype: jnp.dtype) -> dict[str, Any]:
    """What a forward pass in `dtype` reads: compute_params' cast, or the parameters as they are under float32
    compute."""
    return params if dtype == jnp.float32 else compute_params(params, dtype)
