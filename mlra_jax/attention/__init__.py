"""Attention variants of the paper, one module per family, one interface (base.Attention)."""

from __future__ import annotations

import importlib

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache
from mlra_jax.config import ConfigError
from mlra_jax.variants import SPECS, VARIANTS


def attention_class(variant: str) -> type[Attention]:
    """The class that implements `variant`, as its registry entry names it (mlra_jax.variants)."""
    if variant not in SPECS:
        raise ConfigError(f"variant={variant!r} is not valid; allowed values: {', '.join(VARIANTS)}")
    module, name = SPECS[variant].attention.split(".")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = ["Attention", "CacheComponent", "DecodeShape", "KVCache", "attention_class"]
