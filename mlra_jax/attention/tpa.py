"""TPA (reference model/tpa.py): every head's q, k, v is a rank-beta tensor product of
per-head coefficients A [h, beta] and shared components B [beta, head_dim]; RoPE acts
on B_q and B_k. The cache holds A_k, A_v, B_k (roped) and B_v."""

from __future__ import annotations

import jax
from flax import nnx

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache
from mlra_jax.attention.core import attention
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.layers import einsum, make_param, project, xavier_uniform_torch_view


class TensorProductAttention(Attention):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, h, dh = cfg.n_embd, cfg.n_head, cfg.head_dim
        self.rank, self.q_rank = cfg.tpa_rank, cfg.tpa_q_rank

        # The reference draws xavier_uniform on (in, h, rank) and (in, rank, head_dim) views.
        def factor(shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
            return make_param(rngs, shape, axes, xavier_uniform_torch_view(shape), cfg)

        self.a_q = factor((d, h, self.q_rank), ("embed", "q_heads", "tpa_rank"))
        self.a_k = factor((d, h, self.rank), ("embed", "q_heads", "tpa_rank"))
        self.a_v = factor((d, h, self.rank), ("embed", "q_heads", "tpa_rank"))
        self.b_q = factor((d, self.q_rank, dh), ("embed", "tpa_rank", "head_dim"))
        self.b_k = factor((d, self.rank, dh), ("embed", "tpa_rank", "head_dim"))
        self.b_v = factor((d, self.rank, dh), ("embed", "tpa_rank", "head_dim"))
        self.scale = dh**-0.5

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
        rank, dh = cfg.tpa_rank, cfg.head_dim
        return [
            CacheComponent("a_k", cfg.n_head, (rank,), "q_heads"),
            CacheComponent("a_v", cfg.n_head, (rank,), "q_heads"),
            CacheComponent("b_k", 1, (rank, dh), None),
            CacheComponent("b_v", 1, (rank, dh), None),
        ]

    @staticmethod
    def decode_shape(cfg: ModelConfig) -> DecodeShape:
        h, dh, rank = cfg.n_head, cfg.head_dim, cfg.tpa_rank
        # Paper Table 2 counts 4 h beta d_h + 4 h d_h FLOPs per context token.
        return DecodeShape(
            tp=1,
            heads=h,
            qk_dim=dh,
            v_dim=dh,
            cache_elements=2 * rank * (h + dh),
            flops_override=4 * h * rank * dh + 4 * h * dh,
        )

    @staticmethod
    def extra_flops_per_token(cfg: ModelConfig) -> int:
        """The tensor products A B forming q, k and v."""
        return 2 * cfg.n_head * cfg.head_dim * (cfg.tpa_q_rank + 2 * cfg.tpa_rank)

    def cache_entry(self, x: jax.Array, positions: jax.Array) -> KVCache:
        b_k = apply_rope(project(x, self.b_k, "btd,drk->btrk", self.dtype), positions, self.theta)
        return {
            "a_k": project(x, self.a_k, "btd,dhr->bthr", self.dtype),
            "a_v": project(x, self.a_v, "btd,dhr->bthr", self.dtype),
            "b_k": b_k[:, :, None],
            "b_v": project(x, self.b_v, "btd,drk->btrk", self.dtype)[:, :, None],
        }

    def attend(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array | None) -> jax.Array:
        a_q = project(x, self.a_q, "btd,dhr->bthr", self.dtype)
        b_q = apply_rope(project(x, self.b_q, "btd,drk->btrk", self.dtype), positions, self.theta)
        q = einsum("bthr,btrk->bthk", a_q, b_q) / self.q_rank
        k = einsum("bthr,btrk->bthk", kv["a_k"], kv["b_k"][:, :, 0]) / self.rank
        v = einsum("bthr,btrk->bthk", kv["a_v"], kv["b_v"][:, :, 0]) / self.rank
        return attention(q, k, v, scale=self.scale, impl=self.impl, mask=mask)
