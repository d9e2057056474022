"""The one interface every attention variant implements.

A variant computes, per token, exactly what the paper says it caches
(`cache_entry`), and attends from the queries of x over such entries (`attend`).
Training runs both on the same sequence; decoding (mlra_jax.decode) runs
`cache_entry` on new tokens and `attend` over the cache. The gate and the output
projection are shared here. `cache_layout` declares the cached tensors per token:
each has `units` interchangeable slices along axis 2 (KV heads, latent blocks, ...)
that tensor parallelism may split across devices, and `unit_shape` elements each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
from flax import nnx

from mlra_jax import fp8
from mlra_jax.config import ModelConfig
from mlra_jax.layers import dense_init, make_param, output_init, project

KVCache = dict[str, jax.Array]  # name -> [B, T, units, *unit_shape]


@dataclasses.dataclass(frozen=True)
class CacheComponent:
    """One cached tensor per token: `units` slices of `unit_shape` elements each."""

    name: str
    units: int
    unit_shape: tuple[int, ...]
    unit_axis: str | None  # logical axis name of the units (None: one unit, replicated under TP)
    # query heads that read the units, head i reading unit i // (heads / units) (GQA's KV heads); 0: none do, and
    # TP cannot store a unit per device by the heads that read it (tensor_parallel.UnitPlan.aligned)
    read_by_heads: int = 0

    @property
    def unit_elements(self) -> int:
        return math.prod(self.unit_shape)

    @property
    def elements(self) -> int:
        return self.units * self.unit_elements


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The per-device decode attention of the paper's Table 2 at the variant's native TP.

    heads: query heads per device; qk_dim / v_dim: widths each head attends with
    (after weight absorption for the latent family); cache_elements: elements per
    token read per device; tp: the TP degree this describes.
    """

    tp: int
    heads: int
    qk_dim: int
    v_dim: int
    cache_elements: int
    flops_override: int | None = None  # FLOPs per context token where the paper counts otherwise (TPA)

    @property
    def flops_per_token(self) -> int:
        if self.flops_override is not None:
            return self.flops_override
        return self.heads * (2 * self.qk_dim + 2 * self.v_dim)

    def arithmetic_intensity(self, bytes_per_element: int = 2) -> float:
        return self.flops_per_token / (bytes_per_element * self.cache_elements)


class Attention(nnx.Module):
    """Base class: subclasses define q/k/v; this owns the gate and the output projection."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.dtype = cfg.dtype
        self.impl = cfg.attention_impl
        self.fp8_site = cfg.fp8_attention  # whether its attention core may train in FP8 (fp8_attention)
        self.theta = cfg.rope_theta
        self.n_head = cfg.n_head
        dv = cfg.value_head_dim
        self.o_proj = make_param(
            rngs, (cfg.n_head, dv, cfg.n_embd), ("q_heads", "head_dim", "embed"), output_init(cfg), cfg
        )
        self.gate_proj = (
            make_param(rngs, (cfg.n_embd, cfg.n_head, dv), ("embed", "q_heads", "head_dim"), dense_init(cfg), cfg)
            if cfg.gated
            else None
        )

    # -- what subclasses implement -------------------------------------------
    @staticmethod
    def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
        raise NotImplementedError

    @staticmethod
    def decode_shape(cfg: ModelConfig) -> DecodeShape:
        raise NotImplementedError

    @staticmethod
    def core_shape(cfg: ModelConfig) -> tuple[int, int, int]:
        """(heads, query/key width, value width) of the attention as trained, for FLOP counts."""
        return cfg.n_head, cfg.head_dim, cfg.head_dim

    @staticmethod
    def extra_flops_per_token(cfg: ModelConfig) -> int:
        """Forward FLOPs per token beyond the weight matmuls and the attention core."""
        return 0

    def cache_entry(self, x: jax.Array, positions: jax.Array) -> KVCache:
        raise NotImplementedError

    def attend(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array | None) -> jax.Array:
        """[B, T, n_head, d_v] attention output of the queries of x over kv."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------
    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Self-attention over the sequence x [B, T, d] (causal when mask is None). In an FP8 train step its
        attention core is this module's FP8 site (fp8_attention)."""
        with fp8.module_site(self) if self.fp8_site else contextlib.nullcontext():
            heads = self.attend(x, positions, self.cache_entry(x, positions), mask)
        return self.output(x, heads)

    def write_and_attend(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        mask: jax.Array,
        index: jax.Array,
        plans: dict,
        absorbed: bool,
    ) -> tuple[jax.Array, KVCache]:
        """New tokens x [B, T, d]: their entries stored at slot `index` of this layer's cache
        ([B, max_len, stored units, ...], laid out by `plans`), then attention over the cache.
        Returns the heads' output [B, T, h, d_v] (before the output projection) and the cache. The latent
        family overrides this: absorbed weights for decode steps, up-projected keys and values for prefill."""
        del absorbed
        cache = store_entry(cache, self.cache_entry(x, positions), index, plans)
        return self.attend(x, positions, cache, mask), cache

    def attend_and_project(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        mask: jax.Array,
        index: jax.Array,
        plans: dict,
        absorbed: bool,
    ) -> tuple[jax.Array, KVCache]:
        """write_and_attend, then the output projection: the attention's output [B, T, d] and the cache."""
        heads, cache = self.write_and_attend(x, positions, cache, mask, index, plans, absorbed)
        return self.output(x, heads), cache

    def output(self, x: jax.Array, heads_out: jax.Array) -> jax.Array:
        """Optional sigmoid gate computed from x (the attention's input), then the output projection; heads_out
        may hold copies of x's single row (layers.row_copies), and the result has x's rows."""
        heads_out = self.gated(x, heads_out)
        return project(heads_out, self.o_proj, "bthk,hkd->btd", self.dtype)[: x.shape[0]]

    def gated(self, x: jax.Array, heads_out: jax.Array) -> jax.Array:
        """heads_out in the compute dtype, times the sigmoid gate of x (the attention's input) when the model is
        gated."""
        heads_out = heads_out.astype(self.dtype)
        if self.gate_proj is None:
            return heads_out
        return heads_out * jax.nn.sigmoid(project(x, self.gate_proj, "btd,dhk->bthk", self.dtype))


def store_entry(cache: KVCache, entry: KVCache, index: jax.Array, plans: dict) -> KVCache:
    """The cache [B, max_len, stored units, ...] with a new tokens' entry written at slot `index`, each tensor
    laid out by its TP plan."""
    return {
        name: jax.lax.dynamic_update_slice_in_dim(
            cache[name], plans[name].store(entry[name], axis=2).astype(cache[name].dtype), index, axis=1
        )
        for name in cache
    }


def check_cache_entry(layout: list[CacheComponent], entry: KVCache) -> None:
    """Assert that an entry holds exactly the declared components (used by tests and decoding)."""
    names = {c.name for c in layout}
    if set(entry) != names:
        raise ValueError(f"cache entry has {sorted(entry)}, layout declares {sorted(names)}")
    for c in layout:
        got = entry[c.name].shape[2:]
        if got != (c.units, *c.unit_shape):
            raise ValueError(
                f"cache component {c.name!r} has per-token shape {got}, layout declares {(c.units, *c.unit_shape)}"
            )
