"""Each variant's cache_entry computes exactly the tensors its cache_layout declares."""

import jax
import jax.numpy as jnp
import pytest
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.attention.base import check_cache_entry
from mlra_jax.cache_accounting import cache_layout, kv_cache_elements
from mlra_jax.model import init_model
from mlra_jax.variants import VARIANTS


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_entry_matches_layout(variant):
    cfg = tiny_model(variant, n_layer=1, vocab_size=64)
    model = init_model(cfg)
    x = jax.random.normal(jax.random.key(0), (2, 5, cfg.n_embd))
    attn = jax.tree.map(lambda a: a[0], model.blocks).attn  # layer 0
    entry = attn.cache_entry(x, jnp.broadcast_to(jnp.arange(5), (2, 5)))
    check_cache_entry(cache_layout(cfg), entry)
    assert sum(a[0, 0].size for a in entry.values()) == kv_cache_elements(cfg)
