"""The latent family: MLA, GLA-2, GLA-4, MLRA-2 and MLRA-4 in one module.

All five share MLA's query path and one down-projection to a latent of d_c
channels plus a shared RoPE key of d_h^R. They differ only in how the latent is
split and who reads each piece (`ModelConfig.latent_layout`):

    variant  blocks  branches  heads per block   block b serves
    MLA         1        1        h               all heads
    GLA-2       2        1        h/2             heads of group b
    GLA-4       4        1        h/4             heads of group b
    MLRA-2      4        2        h/2             branch b // 2, heads of group b % 2
    MLRA-4      4        4        h               branch b, all heads

Each block has its RMSNorm and its up-projection to k_nope || v for the heads it
serves (paper Sec. 3, Eq. 1-2). Within a branch the heads are concatenated; the
branches are attention outputs summed and scaled by 1/sqrt(branches) (paper Sec.
3.3; the no-scale ablation drops this factor with alpha_q and alpha_kv). The cache
holds the normalized, scaled latent blocks and the roped key (REFERENCE.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache
from mlra_jax.attention.core import attention, latent_attention
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.layers import RMSNorm, dense_init, einsum, make_param, project
from mlra_jax.tensor_parallel import LatentPlan, latent_region, tensor_size


class LatentAttention(Attention):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, h = cfg.n_embd, cfg.n_head
        dq, dh, dr = cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.blocks, self.branches = cfg.latent_layout
        self.block_rank = cfg.kv_lora_rank // self.blocks
        self.block_heads = h * self.branches // self.blocks
        self.nope_dim, self.rope_dim = dh, dr
        init = dense_init(cfg)
        self.q_down = make_param(rngs, (d, dq), ("embed", "q_lora"), init, cfg)
        self.q_norm = RMSNorm((dq,), ("q_lora",), cfg, rngs=rngs)
        self.q_up = make_param(rngs, (dq, h, dh + dr), ("q_lora", "q_heads", "qk_head_dim"), init, cfg)
        self.kv_down = make_param(rngs, (d, self.blocks, self.block_rank), ("embed", "latent_blocks", "latent"),
                                  init, cfg)
        self.k_rope_proj = make_param(rngs, (d, dr), ("embed", "rope_dim"), init, cfg)
        self.kv_norm = RMSNorm((self.blocks, self.block_rank), ("latent_blocks", "latent"), cfg, rngs=rngs)
        self.kv_up = make_param(rngs, (self.blocks, self.block_rank, self.block_heads, 2 * dh),
                                ("latent_blocks", "latent", "block_heads", "kv_head_dim"), init, cfg)
        self.q_scale = math.sqrt(d / dq) if cfg.latent_scale else 1.0
        self.kv_scale = math.sqrt(d / self.block_rank) if cfg.latent_scale else 1.0
        self.softmax_scale = (dh + dr) ** -0.5
        # The reference mlra_2_no_scale.py drops the 1/sqrt(branches) output scale together with
        # the latent scales (its logits show it; REFERENCE.md's note that it stays is wrong).
        self.branch_scale = self.branches ** -0.5 if cfg.latent_scale else 1.0

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
        blocks, _ = cfg.latent_layout
        return [CacheComponent("latent", blocks, (cfg.kv_lora_rank // blocks,), "latent_blocks"),
                CacheComponent("k_rope", 1, (cfg.qk_rope_head_dim,), None)]

    @staticmethod
    def decode_shape(cfg: ModelConfig) -> DecodeShape:
        """One device per latent block: h * branches / blocks heads over one block plus the RoPE key."""
        blocks, branches = cfg.latent_layout
        rank = cfg.kv_lora_rank // blocks
        return DecodeShape(tp=blocks, heads=cfg.n_head * branches // blocks, qk_dim=rank + cfg.qk_rope_head_dim,
                           v_dim=rank, cache_elements=rank + cfg.qk_rope_head_dim)

    @staticmethod
    def core_shape(cfg: ModelConfig) -> tuple[int, int, int]:
        """Every branch attends with all of its heads: branches * h heads of d_h + d_h^R."""
        _, branches = cfg.latent_layout
        return branches * cfg.n_head, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim

    def cache_entry(self, x: jax.Array, positions: jax.Array) -> KVCache:
        latent = self.kv_norm(project(x, self.kv_down, "btd,dnr->btnr", self.dtype)) * self.kv_scale
        k_rope = apply_rope(project(x, self.k_rope_proj, "btd,dr->btr", self.dtype), positions, self.theta)
        return {"latent": latent.astype(self.dtype), "k_rope": k_rope[:, :, None, :]}

    def queries(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q_nope [B, T, h, d_h] and roped q_rope [B, T, h, d_h^R]."""
        c_q = self.q_norm(project(x, self.q_down, "btd,dq->btq", self.dtype)) * self.q_scale
        q = project(c_q.astype(self.dtype), self.q_up, "btq,qhk->bthk", self.dtype)
        return q[..., : self.nope_dim], apply_rope(q[..., self.nope_dim:], positions, self.theta)

    def per_block(self, x: jax.Array) -> jax.Array:
        """[B, T, h, D] -> [B, T, blocks, block_heads, D]: the heads that block b serves."""
        b, t, _, dim = x.shape
        groups = self.blocks // self.branches
        x = x.reshape(b, t, 1, groups, self.block_heads, dim)
        return jnp.broadcast_to(x, (b, t, self.branches, groups, self.block_heads, dim)).reshape(
            b, t, self.blocks, self.block_heads, dim)

    def merge_branches(self, out: jax.Array) -> jax.Array:
        """[B, T, blocks, block_heads, d_h] -> [B, T, h, d_h], summing the branches."""
        b, t = out.shape[:2]
        out = out.reshape(b, t, self.branches, self.n_head, out.shape[-1]).astype(jnp.float32)
        return (out.sum(axis=2) * self.branch_scale).astype(self.dtype)

    def attend(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array | None) -> jax.Array:
        """Training and prefill: each block's latent up-projected to per-head keys and values."""
        return self.run_blocks(self.attend_blocks, x, positions, kv, mask)

    def attend_cache(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array) -> jax.Array:
        """Decoding with absorbed weights (paper Steps 1-3): no per-head key or value is formed."""
        return self.run_blocks(self.absorbed_blocks, x, positions, kv, mask)

    def run_blocks(self, blocks_fn, x: jax.Array, positions: jax.Array, kv: KVCache,
                   mask: jax.Array | None) -> jax.Array:
        """Apply blocks_fn to every latent block locally, or to each device's blocks under TP."""
        q_nope, q_rope = self.queries(x, positions)
        kv_up = self.kv_up[...].astype(self.dtype)
        tp = tensor_size()
        if tp == 1:
            out = blocks_fn(self.per_block(q_nope), self.per_block(q_rope), kv["latent"], kv["k_rope"], kv_up, mask)
            return self.merge_branches(out)
        plan = LatentPlan(self.blocks, self.branches, self.n_head, tp)
        latent = kv["latent"]
        if latent.shape[2] == self.blocks:  # a fresh entry (training, prefill): lay it out as the cache
            latent = plan.units.store(latent, axis=2)
        return latent_region(plan, blocks_fn, (q_nope, q_rope), (latent, kv["k_rope"]), (2, 2), kv_up, mask,
                             self.per_block, self.branch_scale, self.dtype,
                             differentiable=blocks_fn != self.absorbed_blocks)

    def attend_blocks(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                      kv_up: jax.Array, mask: jax.Array | None) -> jax.Array:
        """q [B, T, n, H, .] over latent [B, S, n, R] of n blocks with kv_up [n, R, H, 2 d_h]."""
        # two products rather than one sliced after: v comes out contiguous, as the fused kernels want it
        k_nope = einsum("bsnr,nrhk->bsnhk", latent, kv_up[..., : self.nope_dim])
        v = einsum("bsnr,nrhk->bsnhk", latent, kv_up[..., self.nope_dim:])
        k_rope = jnp.broadcast_to(k_rope[:, :, :, None, :], k_nope.shape[:-1] + (self.rope_dim,))
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        flat = lambda a: a.reshape(a.shape[:2] + (-1, a.shape[-1]))
        out = attention(flat(q), flat(k), flat(v), scale=self.softmax_scale, impl=self.impl, mask=mask)
        return out.reshape(q.shape[:-1] + (self.nope_dim,))

    def absorbed_blocks(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                        kv_up: jax.Array, mask: jax.Array | None) -> jax.Array:
        """Step 1: W_UK into the query; Step 2: MQA over [k_rope || latent]; Step 3: W_UV after."""
        w_uk, w_uv = kv_up[..., : self.nope_dim], kv_up[..., self.nope_dim:]
        q_latent = einsum("btnhk,nrhk->btnhr", q_nope, w_uk).astype(self.dtype)
        z = latent_attention(q_rope, q_latent, k_rope[:, :, 0], latent, scale=self.softmax_scale, mask=mask,
                             impl=self.impl)
        return einsum("btnhr,nrhk->btnhk", z, w_uv)
