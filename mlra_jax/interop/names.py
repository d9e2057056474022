"""The declarative table between our parameter tree and the reference state_dict names.

One `Rule` ties some of our parameters to some reference tensors through a layout
transform. Three shapes of rule cover every variant:
  * one to one     (ours, ref)               e.g. attn.q_up <-> attn.q_b_proj.weight
  * stacked        (ours, [ref_0, ref_1..])  our leading block axis <-> one tensor per block
  * split          ([ours_0, ours_1], ref)   one reference tensor <-> consecutive row ranges
Layer rules are relative to `transformer.h.{i}.` and to our stacked `blocks`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from mlra_jax.config import ModelConfig

Array = Any  # numpy array, jax array or tracer


def array_module(*arrays: Array) -> Any:
    """numpy for numpy inputs (conversion on the host), jax.numpy for jax arrays and tracers."""
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


@dataclasses.dataclass(frozen=True)
class Same:
    """Identical layout (norm weights, embedding)."""

    def to_ref(self, x: Array) -> Array:
        return x

    def from_ref(self, x: Array, shape: tuple[int, ...]) -> Array:
        return x.reshape(shape)

    def ref_rows(self, shape: tuple[int, ...]) -> int:
        return shape[0]


@dataclasses.dataclass(frozen=True)
class Linear:
    """torch nn.Linear weight [out, in] <-> our kernel [in dims..., out dims...]."""

    n_in: int = 1

    def to_ref(self, x: Array) -> Array:
        n_in = math.prod(x.shape[: self.n_in])
        return x.reshape(n_in, -1).T

    def from_ref(self, x: Array, shape: tuple[int, ...]) -> Array:
        return x.T.reshape(shape)

    def ref_rows(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape[self.n_in :])


@dataclasses.dataclass(frozen=True)
class MergeLast:
    """A raw reference Parameter [..., heads * width] <-> ours [..., heads, width]."""

    def to_ref(self, x: Array) -> Array:
        return x.reshape(x.shape[:-2] + (-1,))

    def from_ref(self, x: Array, shape: tuple[int, ...]) -> Array:
        return x.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]
    refs: tuple[str, ...]
    layout: Same | Linear | MergeLast
    stacked: bool = False  # our leading axis indexes `refs` (also a stack of one: MLA's single block)

    def to_ref(self, arrays: Sequence[Array]) -> list[Array]:
        if len(self.ours) > 1:  # split: concatenate our pieces along the reference rows
            return [array_module(*arrays).concatenate([self.layout.to_ref(a) for a in arrays], axis=0)]
        if self.stacked:
            return [self.layout.to_ref(arrays[0][j]) for j in range(len(self.refs))]
        return [self.layout.to_ref(arrays[0])]

    def from_ref(self, arrays: Sequence[Array], shapes: Sequence[tuple[int, ...]]) -> list[Array]:
        if len(self.ours) > 1:
            bounds = np.cumsum([self.layout.ref_rows(s) for s in shapes])[:-1]
            pieces = array_module(arrays[0]).split(arrays[0], bounds, axis=0)
            return [self.layout.from_ref(p, s) for p, s in zip(pieces, shapes)]
        if self.stacked:
            return [array_module(*arrays).stack([self.layout.from_ref(a, shapes[0][1:]) for a in arrays])]
        return [self.layout.from_ref(arrays[0], shapes[0])]


TOP_RULES = (
    Rule(("embed.embedding",), ("transformer.wte.weight",), Same()),
    Rule(("final_norm.scale",), ("layernorm.weight",), Same()),
)
TIED_KEY, EMBEDDING_KEY = "lm_head.weight", "transformer.wte.weight"
LAYER_PREFIX = "transformer.h.{i}."

_COMMON_LAYER_RULES = (
    Rule(("attn_norm.scale",), ("input_layernorm.weight",), Same()),
    Rule(("mlp_norm.scale",), ("post_attention_layernorm.weight",), Same()),
    Rule(("mlp.gate_proj",), ("mlp.c_fc1.weight",), Linear()),
    Rule(("mlp.up_proj",), ("mlp.c_fc2.weight",), Linear()),
    Rule(("mlp.down_proj",), ("mlp.c_proj.weight",), Linear()),
    Rule(("attn.o_proj",), ("attn.c_proj.weight",), Linear(n_in=2)),
)


def _gqa_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return tuple(
        Rule((f"attn.{ours}",), (f"attn.{ref}.weight",), Linear())
        for ours, ref in (("q_proj", "c_q"), ("k_proj", "c_k"), ("v_proj", "c_v"))
    )


def _latent_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    blocks, _ = cfg.latent_layout
    reference = cfg.spec.reference_stem
    if reference == "mla":
        norms = ("attn.kv_a_layernorm.weight",)
        up = Rule(("attn.kv_up",), ("attn.kv_b_proj.weight",), Linear(), stacked=True)
    elif reference == "gla_2":
        norms = ("attn.kv_a_layernorm_1.weight", "attn.kv_a_layernorm_2.weight")
        up = Rule(("attn.kv_up",), ("attn.kv_b_proj_1.weight", "attn.kv_b_proj_2.weight"), Linear(), stacked=True)
    else:  # gla_4, mlra_2, mlra_4: a raw [blocks, rank, heads * 2 d_h] Parameter
        norms = tuple(f"attn.kv_a_layernorms.{j}.weight" for j in range(blocks))
        up = Rule(("attn.kv_up",), ("attn.kv_b_proj",), MergeLast())
    return (
        Rule(("attn.q_down",), ("attn.q_a_proj.weight",), Linear()),
        Rule(("attn.q_norm.scale",), ("attn.q_a_layernorm.weight",), Same()),
        Rule(("attn.q_up",), ("attn.q_b_proj.weight",), Linear()),
        Rule(("attn.kv_down", "attn.k_rope_proj"), ("attn.kv_a_proj_with_mqa.weight",), Linear()),
        Rule(("attn.kv_norm.scale",), norms, Same(), stacked=True),
        up,
    )


def _mfa_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return (
        Rule(("attn.q_down",), ("attn.c_q.weight",), Linear()),
        Rule(("attn.q_norm.scale",), ("attn.q_layernorm.weight",), Same()),
        Rule(("attn.q_up",), ("attn.w_q.weight",), Linear()),
        Rule(("attn.k_proj",), ("attn.c_k.weight",), Linear()),
        Rule(("attn.v_proj",), ("attn.c_v.weight",), Linear()),
    )


def _tpa_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return tuple(
        Rule((f"attn.{f}_{p}",), (f"attn.c_qkv.W_{f.upper()}_{p}.weight",), Linear())
        for f in ("a", "b")
        for p in ("q", "k", "v")
    )


def _gta_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return (
        Rule(("attn.q_proj",), ("attn.c_q.weight",), Linear()),
        Rule(("attn.kv_proj",), ("attn.kv_proj.weight",), Linear()),
        Rule(("attn.k_rope_proj",), ("attn.W_rope_k.weight",), Linear()),
    )


# attention family (the variant spec's module) -> its attention parameters' rules
_FAMILY_RULES = {"gqa": _gqa_rules, "latent": _latent_rules, "mfa": _mfa_rules, "tpa": _tpa_rules, "gta": _gta_rules}


def layer_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    family = cfg.spec.family
    if family not in _FAMILY_RULES:
        raise ValueError(f"no reference names for variant {cfg.variant!r}")
    rules = _COMMON_LAYER_RULES + _FAMILY_RULES[family](cfg)
    if cfg.gated:
        # The reference names the gate c_gated in gqa_gated.py and gated_proj in the latent files.
        gate = "attn.c_gated.weight" if family == "gqa" else "attn.gated_proj.weight"
        rules += (Rule(("attn.gate_proj",), (gate,), Linear()),)
    return rules
