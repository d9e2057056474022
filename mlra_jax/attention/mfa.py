"""MFA (reference model/mfa.py): a low-rank, RMS-normalized query path (no scale
factor) up-projected to h heads of head_dim, attending over one shared K and V head."""

from __future__ import annotations

import jax
from flax import nnx

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache
from mlra_jax.attention.core import attention
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.layers import RMSNorm, dense_init, make_param, project


class MultiMatrixFactorizationAttention(Attention):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, h, dh, dq = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.q_lora_rank
        init = dense_init(cfg)
        self.q_down = make_param(rngs, (d, dq), ("embed", "q_lora"), init, cfg)
        self.q_norm = RMSNorm((dq,), ("q_lora",), cfg, rngs=rngs)
        self.q_up = make_param(rngs, (dq, h, dh), ("q_lora", "q_heads", "head_dim"), init, cfg)
        self.k_proj = make_param(rngs, (d, dh), ("embed", "head_dim"), init, cfg)
        self.v_proj = make_param(rngs, (d, dh), ("embed", "head_dim"), init, cfg)
        self.scale = dh**-0.5

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
        return [CacheComponent(name, 1, (cfg.head_dim,), None) for name in ("k", "v")]

    @staticmethod
    def decode_shape(cfg: ModelConfig) -> DecodeShape:
        return DecodeShape(
            tp=1, heads=cfg.n_head, qk_dim=cfg.head_dim, v_dim=cfg.head_dim, cache_elements=2 * cfg.head_dim
        )

    def cache_entry(self, x: jax.Array, positions: jax.Array) -> KVCache:
        k = apply_rope(project(x, self.k_proj, "btd,dk->btk", self.dtype), positions, self.theta)
        v = project(x, self.v_proj, "btd,dk->btk", self.dtype)
        return {"k": k[:, :, None, :], "v": v[:, :, None, :]}

    def attend(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array | None) -> jax.Array:
        c_q = self.q_norm(project(x, self.q_down, "btd,dq->btq", self.dtype))
        q = apply_rope(project(c_q, self.q_up, "btq,qhk->bthk", self.dtype), positions, self.theta)
        return attention(q, kv["k"], kv["v"], scale=self.scale, impl=self.impl, mask=mask)
