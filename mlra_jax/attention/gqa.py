"""MHA, MQA and GQA (reference model/mha.py, model/gqa.py): RoPE on the full head,
KV head i // group_size serves query head i. MHA is group_size 1, MQA group_size n_head."""

from __future__ import annotations

import jax
from flax import nnx

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache
from mlra_jax.attention.core import attention
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.layers import dense_init, make_param, project


class GroupedQueryAttention(Attention):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, h, g, dh = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = make_param(rngs, (d, h, dh), ("embed", "q_heads", "head_dim"), dense_init(cfg), cfg)
        self.k_proj = make_param(rngs, (d, g, dh), ("embed", "kv_heads", "head_dim"), dense_init(cfg), cfg)
        self.v_proj = make_param(rngs, (d, g, dh), ("embed", "kv_heads", "head_dim"), dense_init(cfg), cfg)
        self.scale = dh**-0.5

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
        return [CacheComponent(name, cfg.n_kv_head, (cfg.head_dim,), "kv_heads") for name in ("k", "v")]

    @staticmethod
    def decode_shape(cfg: ModelConfig) -> DecodeShape:
        return DecodeShape(
            tp=1,
            heads=cfg.n_head,
            qk_dim=cfg.head_dim,
            v_dim=cfg.head_dim,
            cache_elements=2 * cfg.n_kv_head * cfg.head_dim,
        )

    def cache_entry(self, x: jax.Array, positions: jax.Array) -> KVCache:
        k = apply_rope(project(x, self.k_proj, "btd,dhk->bthk", self.dtype), positions, self.theta)
        return {"k": k, "v": project(x, self.v_proj, "btd,dhk->bthk", self.dtype)}

    def attend(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array | None) -> jax.Array:
        q = apply_rope(project(x, self.q_proj, "btd,dhk->bthk", self.dtype), positions, self.theta)
        return attention(q, kv["k"], kv["v"], scale=self.scale, impl=self.impl, mask=mask)
