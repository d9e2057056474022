"""Convert between our parameters and the reference PyTorch state_dict (numpy arrays).

`to_state_dict` writes every reference key, both tied keys included;
`from_state_dict` validates a reference state_dict completely (keys, layer count,
shapes, float dtypes, tied weights, finite values) before converting anything, so a mismatched
checkpoint fails with a message that names the problem and leaves the model as it was.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlra_jax.config import ModelConfig
from mlra_jax.interop.names import EMBEDDING_KEY, LAYER_PREFIX, TIED_KEY, TOP_RULES, array_module, layer_rules
from mlra_jax.model import abstract_model
from mlra_jax.params import flat_params, set_flat_params


class StateDictError(ValueError):
    """A reference state_dict does not fit the model; the message says how."""


def _rules_with_names(cfg: ModelConfig):
    """(rule, our paths, reference keys, layer index or None) for every tensor."""
    for rule in TOP_RULES:
        yield rule, list(rule.ours), list(rule.refs), None
    for i in range(cfg.n_layer):
        prefix = LAYER_PREFIX.format(i=i)
        for rule in layer_rules(cfg):
            yield rule, [f"blocks.{p}" for p in rule.ours], [prefix + r for r in rule.refs], i


def to_state_dict(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Our flat params (see params.flat_params) -> {reference name: array}."""
    state_dict = {}
    for rule, ours, refs, layer in _rules_with_names(cfg):
        arrays = [params[p] if layer is None else params[p][layer] for p in ours]
        state_dict.update(zip(refs, rule.to_ref(arrays)))
    state_dict[TIED_KEY] = state_dict[EMBEDDING_KEY]
    return state_dict


def model_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The reference state_dict of a model, as numpy arrays in the parameter dtype."""
    params = {p: np.asarray(jax.device_get(a)) for p, a in flat_params(model).items()}
    return to_state_dict(params, model.config)


def reference_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Reference names and shapes of a config, computed without allocating weights."""
    abstract = flat_params(abstract_model(cfg))
    shapes = jax.eval_shape(lambda p: to_state_dict(p, cfg), abstract)
    return {name: tuple(s.shape) for name, s in shapes.items()}


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; bfloat16 has no numpy dtype
        x = x.detach().cpu()
        x = x.float() if str(x.dtype) == "torch.bfloat16" else x
        return x.numpy()
    return np.asarray(x)


def guess_variant(keys: set[str]) -> str:
    """A best guess at the reference file a state_dict comes from, from its layer-0 names."""
    attn = {k.removeprefix("transformer.h.0.attn.") for k in keys if k.startswith("transformer.h.0.attn.")}
    gated = " (gated)" if attn & {"c_gated.weight", "gated_proj.weight"} else ""
    for marker, name in (
        ("kv_a_layernorm.weight", "mla"),
        ("kv_a_layernorm_1.weight", "gla2"),
        ("kv_a_layernorms.0.weight", "gla4, mlra2 or mlra4"),
        ("c_qkv.W_A_q.weight", "tpa"),
        ("W_rope_k.weight", "gta"),
        ("w_q.weight", "mfa"),
        ("c_q.weight", "mha, mqa or gqa"),
    ):
        if marker in attn:
            return name + gated
    return "unknown"


def _check_keys(state_dict: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    keys, wanted = set(state_dict), set(expected) - {TIED_KEY}
    layers = {int(m.group(1)) for k in keys if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if layers and max(layers) + 1 != cfg.n_layer:
        raise StateDictError(
            f"state_dict has {max(layers) + 1} layers but the config has n_layer={cfg.n_layer}; "
            f"set n_layer={max(layers) + 1}"
        )
    missing, unexpected = sorted(wanted - keys), sorted(keys - set(expected))
    if missing or unexpected:
        detail = []
        if missing:
            detail.append(f"{len(missing)} missing (e.g. {', '.join(missing[:4])})")
        if unexpected:
            detail.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:4])})")
        raise StateDictError(
            f"state_dict does not match variant {cfg.variant!r}"
            f"{' (gated)' if cfg.gated else ''}: {'; '.join(detail)}. The state_dict looks like "
            f"{guess_variant(keys)}; build the model with that variant's config"
        )


def _widened(a: np.ndarray) -> np.ndarray | None:
    """A float array in at least float32 (bfloat16 and float16 exactly), None for other dtypes."""
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return None
    return a.astype(np.float32) if a.dtype.itemsize < 4 else a


def _check_values(arrays: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]], dtype: np.dtype) -> None:
    wrong = [f"{k}: expected {expected[k]}, got {a.shape}" for k, a in arrays.items() if a.shape != expected[k]]
    if wrong:
        raise StateDictError(
            f"{len(wrong)} tensors have the wrong shape for this config (check n_embd, n_head, "
            f"head dims, ranks and intermediate_size): {'; '.join(wrong[:4])}"
        )
    not_float = [f"{k} ({a.dtype})" for k, a in arrays.items() if not jnp.issubdtype(a.dtype, jnp.floating)]
    if not_float:
        raise StateDictError(
            f"{len(not_float)} tensors are not floating point: {', '.join(not_float[:4])}. Weights "
            f"are floats; cast to {np.dtype(dtype).name} they would be other numbers than the model "
            f"was trained with (a quantized or altered checkpoint?); give the float checkpoint"
        )
    widened = {k: w for k, a in arrays.items() if (w := _widened(a)) is not None and w.size}
    bad = [k for k, w in widened.items() if not np.isfinite(w).all()]
    if bad:
        raise StateDictError(f"{len(bad)} tensors hold NaN or inf, the checkpoint is corrupt: {', '.join(bad[:4])}")
    limit = float(jnp.finfo(dtype).max)
    large = [f"{k} (|x| up to {float(np.abs(w).max()):.3g})" for k, w in widened.items() if np.abs(w).max() > limit]
    if large:
        raise StateDictError(
            f"{len(large)} tensors hold values beyond the largest {np.dtype(dtype).name} "
            f"({limit:.3g}), the parameter dtype they would become inf in: {', '.join(large[:4])}; "
            f"load into a wider param_dtype or check the checkpoint"
        )
    if TIED_KEY in arrays and not np.array_equal(arrays[TIED_KEY], arrays[EMBEDDING_KEY]):
        raise StateDictError(
            f"{TIED_KEY} differs from {EMBEDDING_KEY}, but this model ties them; "
            f"the checkpoint is not from the reference implementation"
        )


def convert_from_reference(state_dict: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The layout conversion alone, without validation: reference names -> our flat params.

    Works on numpy arrays and, for shape checks, under jax.eval_shape."""
    shapes = {p: tuple(s.shape) for p, s in flat_params(abstract_model(cfg)).items()}
    per_layer: dict[str, list[Any]] = {}
    params: dict[str, Any] = {}
    for rule, ours, refs, layer in _rules_with_names(cfg):
        target = [shapes[p] if layer is None else shapes[p][1:] for p in ours]
        for path, value in zip(ours, rule.from_ref([state_dict[r] for r in refs], target)):
            if layer is None:
                params[path] = value
            else:
                per_layer.setdefault(path, []).append(value)
    params.update({path: array_module(*values).stack(values) for path, values in per_layer.items()})
    return params


def from_state_dict(state_dict: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A reference state_dict -> our flat params (numpy in the parameter dtype, layers stacked)."""
    expected = reference_shapes(cfg)
    _check_keys(state_dict, expected, cfg)
    arrays = {k: _as_numpy(v) for k, v in state_dict.items()}
    dtype = np.dtype(cfg.weight_dtype)
    _check_values(arrays, expected, dtype)
    return {p: np.asarray(v, dtype=dtype) for p, v in convert_from_reference(arrays, cfg).items()}


def load_state_dict(model: nnx.Module, state_dict: Mapping[str, Any]) -> None:
    """Load a reference state_dict into `model` in place (validated first)."""
    set_flat_params(model, from_state_dict(state_dict, model.config))
