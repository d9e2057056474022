"""KV-cache accounting and decode arithmetic intensity (paper Tables 1 and 2).

Everything derives from what each variant declares it caches (`cache_layout`) and
from its decode shape (`decode_shape`): nothing here is a per-variant formula.
Under tensor parallelism a cached tensor is stored as tensor_parallel.UnitPlan says:
split when TP divides its slices, one slice per device when its slices divide TP
(MLA's single latent, GLA-2's halves over 4 devices), the slices each device's query heads read
when TP divides the query heads (GQA's 6 KV heads at TP=4: 2 per device), all slices on every device
otherwise. The tests measure the same numbers on real sharded caches.
"""

from __future__ import annotations

import dataclasses

from mlra_jax.attention import DecodeShape, attention_class
from mlra_jax.attention.base import CacheComponent
from mlra_jax.config import ModelConfig
from mlra_jax.tensor_parallel import UnitPlan


def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
    return attention_class(cfg.variant).cache_layout(cfg)


def kv_cache_elements(cfg: ModelConfig) -> int:
    """Cached elements per token per layer."""
    return sum(c.elements for c in cache_layout(cfg))


def per_device_kv_elements(cfg: ModelConfig, tp: int) -> int:
    """Cached elements per token per layer that each of `tp` devices stores and loads."""
    return sum(UnitPlan(c.units, tp, c.read_by_heads).per_device * c.unit_elements for c in cache_layout(cfg))


def replicated_under(cfg: ModelConfig, tp: int) -> list[str]:
    """Cached tensors with several slices that TP=tp can neither split nor spread (kept whole everywhere)."""
    return [c.name for c in cache_layout(cfg) if UnitPlan(c.units, tp, c.read_by_heads).replicated_fallback]


def decode_shape(cfg: ModelConfig) -> DecodeShape:
    return attention_class(cfg.variant).decode_shape(cfg)


@dataclasses.dataclass(frozen=True)
class CacheReport:
    variant: str
    d_h: int
    kv_cache_elements: int
    per_device: dict[int, int]  # TP degree -> elements per token per device
    replicated: dict[int, list[str]]  # TP degree -> tensors that fall back to replication
    decode: DecodeShape

    def in_d_h(self, elements: int | None) -> float | None:
        return None if elements is None else elements / self.d_h


def cache_report(cfg: ModelConfig, tp_degrees: tuple[int, ...] = (1, 2, 4, 8)) -> CacheReport:
    return CacheReport(
        cfg.variant,
        cfg.d_h,
        kv_cache_elements(cfg),
        {tp: per_device_kv_elements(cfg, tp) for tp in tp_degrees},
        {tp: replicated_under(cfg, tp) for tp in tp_degrees},
        decode_shape(cfg),
    )
