"""Attention variants of the paper, one module per family, one interface (base.Attention)."""

from __future__ import annotations

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache
from mlra_jax.attention.gqa import GroupedQueryAttention
from mlra_jax.attention.gta import GroupedTiedAttention
from mlra_jax.attention.latent import LatentAttention
from mlra_jax.attention.mfa import MultiMatrixFactorizationAttention
from mlra_jax.attention.tpa import TensorProductAttention
from mlra_jax.config import VARIANTS, ConfigError

ATTENTION_CLASSES: dict[str, type[Attention]] = {
    "mha": GroupedQueryAttention,
    "mqa": GroupedQueryAttention,
    "gqa": GroupedQueryAttention,
    "mla": LatentAttention,
    "gla2": LatentAttention,
    "gla4": LatentAttention,
    "mlra2": LatentAttention,
    "mlra4": LatentAttention,
    "mfa": MultiMatrixFactorizationAttention,
    "tpa": TensorProductAttention,
    "gta": GroupedTiedAttention,
}
assert set(ATTENTION_CLASSES) == set(VARIANTS)


def attention_class(variant: str) -> type[Attention]:
    if variant not in ATTENTION_CLASSES:
        raise ConfigError(f"variant={variant!r} is not valid; allowed values: {', '.join(VARIANTS)}")
    return ATTENTION_CLASSES[variant]


__all__ = ["ATTENTION_CLASSES", "Attention", "CacheComponent", "DecodeShape", "KVCache", "attention_class"]
