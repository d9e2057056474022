"""KV-cache accounting and decode arithmetic intensity (paper Tables 1 and 2).

Everything derives from what each variant declares it caches (`cache_layout`) and
from its decode shape (`decode_shape`): nothing here is a per-variant formula.
Under tensor parallelism a cached tensor of `units` slices is split evenly when TP
divides `units`; when `units` divides TP each device keeps one slice (the others
replicate it, e.g. MLA's single latent, or GLA-2's two halves over 4 devices).
"""

from __future__ import annotations

import dataclasses

from mlra_jax.attention import DecodeShape, attention_class
from mlra_jax.attention.base import CacheComponent
from mlra_jax.config import LATENT_LAYOUTS, ModelConfig


class ShardingError(ValueError):
    """A cached tensor cannot be divided evenly over the requested tensor-parallel degree."""


def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
    return attention_class(cfg.variant).cache_layout(cfg)


def kv_cache_elements(cfg: ModelConfig) -> int:
    """Cached elements per token per layer."""
    return sum(c.elements for c in cache_layout(cfg))


def units_per_device(component: CacheComponent, tp: int) -> int:
    if component.units % tp == 0:
        return component.units // tp
    if tp % component.units == 0:
        return 1
    raise ShardingError(f"{component.name}: {component.units} {component.unit_axis or 'slices'} cannot be divided "
                        f"over {tp} devices; use a TP degree that divides {component.units} or is a multiple of it")


def per_device_kv_elements(cfg: ModelConfig, tp: int) -> int:
    """Cached elements per token per layer that each of `tp` devices stores and loads."""
    return sum(units_per_device(c, tp) * c.unit_elements for c in cache_layout(cfg))


def head_dim_unit(cfg: ModelConfig) -> int:
    """The paper's d_h for the variant (MFA's heads are 2 d_h wide)."""
    if cfg.variant in LATENT_LAYOUTS:
        return cfg.qk_nope_head_dim
    return cfg.head_dim // 2 if cfg.variant == "mfa" else cfg.head_dim


def decode_shape(cfg: ModelConfig) -> DecodeShape:
    return attention_class(cfg.variant).decode_shape(cfg)


@dataclasses.dataclass(frozen=True)
class CacheReport:
    variant: str
    d_h: int
    kv_cache_elements: int
    per_device: dict[int, int | None]  # TP degree -> elements per token per device (None: not divisible)
    decode: DecodeShape

    def in_d_h(self, elements: int | None) -> float | None:
        return None if elements is None else elements / self.d_h


def cache_report(cfg: ModelConfig, tp_degrees: tuple[int, ...] = (1, 2, 4, 8)) -> CacheReport:
    per_device: dict[int, int | None] = {}
    for tp in tp_degrees:
        try:
            per_device[tp] = per_device_kv_elements(cfg, tp)
        except ShardingError:
            per_device[tp] = None
    return CacheReport(cfg.variant, head_dim_unit(cfg), kv_cache_elements(cfg), per_device, decode_shape(cfg))
