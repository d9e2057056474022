"""GTA (reference model/gta.py): g grouped KV heads whose first half is tied between
key and value, plus one shared RoPE key of head_dim/2 that completes every key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache
from mlra_jax.attention.core import attention
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.layers import dense_init, make_param, project


class GroupedTiedAttention(Attention):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, h, g, dh = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        init = dense_init(cfg)
        self.q_proj = make_param(rngs, (d, h, dh), ("embed", "q_heads", "head_dim"), init, cfg)
        self.kv_proj = make_param(rngs, (d, g, dh), ("embed", "kv_heads", "head_dim"), init, cfg)
        self.k_rope_proj = make_param(rngs, (d, dh // 2), ("embed", "rope_dim"), init, cfg)
        self.tied_dim = dh // 2
        self.scale = dh**-0.5

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
        return [
            CacheComponent("kv", cfg.n_kv_head, (cfg.head_dim,), "kv_heads"),
            CacheComponent("k_rope", 1, (cfg.head_dim // 2,), None),
        ]

    @staticmethod
    def decode_shape(cfg: ModelConfig) -> DecodeShape:
        return DecodeShape(
            tp=1,
            heads=cfg.n_head,
            qk_dim=cfg.head_dim,
            v_dim=cfg.head_dim,
            cache_elements=cfg.n_kv_head * cfg.head_dim + cfg.head_dim // 2,
        )

    def cache_entry(self, x: jax.Array, positions: jax.Array) -> KVCache:
        k_rope = apply_rope(project(x, self.k_rope_proj, "btd,dr->btr", self.dtype), positions, self.theta)
        return {"kv": project(x, self.kv_proj, "btd,dhk->bthk", self.dtype), "k_rope": k_rope[:, :, None, :]}

    def attend(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array | None) -> jax.Array:
        q = project(x, self.q_proj, "btd,dhk->bthk", self.dtype)
        q = jnp.concatenate([q[..., : self.tied_dim], apply_rope(q[..., self.tied_dim :], positions, self.theta)], -1)
        tied = kv["kv"][..., : self.tied_dim]
        k = jnp.concatenate([tied, jnp.broadcast_to(kv["k_rope"], tied.shape)], axis=-1)
        return attention(q, k, kv["kv"], scale=self.scale, impl=self.impl, mask=mask)
