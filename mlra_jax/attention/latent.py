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
holds the normalized, scaled latent blocks and the roped key (docs/conventions.md).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache, store_entry
from mlra_jax.attention.core import attention, latent_attention
from mlra_jax.attention.mlra_kernel import MLRA_KERNEL, mlra_kernel_attention, tensor_parallel_error, use_kernel
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.layers import RMSNorm, dense_init, einsum, make_param, project, row_copies
from mlra_jax.sharding import automatic_axes, split_batch_axes
from mlra_jax.tensor_parallel import (
    TENSOR,
    LatentPlan,
    RegionLayout,
    decode_layout,
    prefill_layout,
    reduce_dtype,
    tensor_size,
    train_layout,
)

# train: fresh entries, differentiated; prefill: over the cache, keys and values up-projected;
# decode: over the cache with absorbed weights.
Mode = Literal["train", "prefill", "decode"]


class LatentAttention(Attention):
    # latent_keys="auto" builds the keys in one product up to this block width: on an H100 the product was faster
    # with 128-wide blocks (MLRA-4), no faster at 512 (MLA) and slower at 256 (GLA-2), whose up-projections
    # spend more FLOPs per key (experiments/results/train_h100_latent_keys.json)
    PRODUCT_KEYS_MAX_RANK = 128

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        d, h = cfg.n_embd, cfg.n_head
        dq, dh, dr = cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.blocks, self.branches = cfg.latent_layout
        self.block_rank = cfg.kv_lora_rank // self.blocks
        self.block_heads = h * self.branches // self.blocks
        self.q_rank, self.nope_dim, self.rope_dim = dq, dh, dr
        init = dense_init(cfg)
        self.q_down = make_param(rngs, (d, dq), ("embed", "q_lora"), init, cfg)
        self.q_norm = RMSNorm((dq,), ("q_lora",), cfg, rngs=rngs)
        self.q_up = make_param(rngs, (dq, h, dh + dr), ("q_lora", "q_heads", "qk_head_dim"), init, cfg)
        self.kv_down = make_param(
            rngs, (d, self.blocks, self.block_rank), ("embed", "latent_blocks", "latent"), init, cfg
        )
        self.k_rope_proj = make_param(rngs, (d, dr), ("embed", "rope_dim"), init, cfg)
        self.kv_norm = RMSNorm((self.blocks, self.block_rank), ("latent_blocks", "latent"), cfg, rngs=rngs)
        self.kv_up = make_param(
            rngs,
            (self.blocks, self.block_rank, self.block_heads, 2 * dh),
            ("latent_blocks", "latent", "block_heads", "kv_head_dim"),
            init,
            cfg,
        )
        self.q_scale = math.sqrt(d / dq) if cfg.latent_scale else 1.0
        self.kv_scale = math.sqrt(d / self.block_rank) if cfg.latent_scale else 1.0
        self.softmax_scale = (dh + dr) ** -0.5
        # The reference mlra_2_no_scale.py drops the 1/sqrt(branches) output scale together with
        # the latent scales (its logits show it).
        self.branch_scale = branch_scale(cfg)
        self.absorbed_training = cfg.trains_absorbed  # training attention absorbed (ModelConfig.latent_form)
        self.mlra_backward = cfg.mlra_backward
        self.auto_form = cfg.latent_form == "auto" and not cfg.trains_absorbed  # absorbed where the kernel runs
        self.product_keys = cfg.latent_keys == "product" or (
            cfg.latent_keys == "auto" and self.block_rank <= self.PRODUCT_KEYS_MAX_RANK
        )
        # Decode steps under TP project the heads' output inside the blocks' region where each device serves every
        # head (LatentPlan.serves_every_head), with o_proj whole on every device: set by the serving layer, which
        # holds o_proj so (decode.layouts.tensor_parallel_weights).
        self.project_in_region = False

    @staticmethod
    def cache_layout(cfg: ModelConfig) -> list[CacheComponent]:
        blocks, _ = cfg.latent_layout
        return [
            CacheComponent("latent", blocks, (cfg.kv_lora_rank // blocks,), "latent_blocks"),
            CacheComponent("k_rope", 1, (cfg.qk_rope_head_dim,), None),
        ]

    @staticmethod
    def decode_shape(cfg: ModelConfig) -> DecodeShape:
        """One device per latent block: h * branches / blocks heads over one block plus the RoPE key."""
        blocks, branches = cfg.latent_layout
        rank = cfg.kv_lora_rank // blocks
        return DecodeShape(
            tp=blocks,
            heads=cfg.n_head * branches // blocks,
            qk_dim=rank + cfg.qk_rope_head_dim,
            v_dim=rank,
            cache_elements=rank + cfg.qk_rope_head_dim,
        )

    @staticmethod
    def core_shape(cfg: ModelConfig) -> tuple[int, int, int]:
        """Every branch attends with all of its heads: branches * h heads of d_h + d_h^R."""
        _, branches = cfg.latent_layout
        return branches * cfg.n_head, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim

    def cache_entry(self, x: jax.Array, positions: jax.Array) -> KVCache:
        return self.entry_from(*self.kv_projections(x), positions)

    def kv_projections(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x's latent [B, T, n, R] and RoPE key [B, T, d_h^R] projections, as stored (before norm and RoPE)."""
        return (
            project(x, self.kv_down, "btd,dnr->btnr", self.dtype),
            project(x, self.k_rope_proj, "btd,dr->btr", self.dtype),
        )

    def q_projection(self, x: jax.Array) -> jax.Array:
        """x's query down-projection c_q [B, T, d_c'], as stored (before its norm)."""
        return project(x, self.q_down, "btd,dq->btq", self.dtype)

    def entry_from(self, latent: jax.Array, k_rope: jax.Array, positions: jax.Array) -> KVCache:
        """The cache entry from x's projections: latent [B, T, n, R] normalized and scaled, k_rope [B, T, d_h^R]
        roped."""
        latent = self.kv_norm(latent) * self.kv_scale
        k_rope = apply_rope(k_rope, positions, self.theta)
        return {"latent": latent.astype(self.dtype), "k_rope": k_rope[:, :, None, :]}

    def queries(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q_nope [B, T, h, d_h] and roped q_rope [B, T, h, d_h^R]."""
        return self.queries_from(self.q_projection(x), positions)

    def queries_from(self, c_q: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The queries from x's query down-projection c_q [B, T, d_c']."""
        return self.split_query(project(self.normed_query(c_q), self.q_up, "btq,qhk->bthk", self.dtype), positions)

    def normed_query(self, c_q: jax.Array) -> jax.Array:
        """c_q normalized and scaled, in the compute dtype: what q_up multiplies."""
        return (self.q_norm(c_q) * self.q_scale).astype(self.dtype)

    def split_query(self, q: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The up-projected queries [B, T, h, d_h + d_h^R] as q_nope [B, T, h, d_h] and roped q_rope."""
        return q[..., : self.nope_dim], apply_rope(q[..., self.nope_dim :], positions, self.theta)

    def per_block(self, x: jax.Array) -> jax.Array:
        """[B, T, h, D] -> [B, T, blocks, block_heads, D]: the heads that block b serves."""
        b, t, _, dim = x.shape
        groups = self.blocks // self.branches
        x = x.reshape(b, t, 1, groups, self.block_heads, dim)
        return jnp.broadcast_to(x, (b, t, self.branches, groups, self.block_heads, dim)).reshape(
            b, t, self.blocks, self.block_heads, dim
        )

    def merge_branches(self, out: jax.Array) -> jax.Array:
        """[B, T, blocks, block_heads, d_h] -> [B, T, h, d_h], summing the branches."""
        b, t = out.shape[:2]
        out = out.reshape(b, t, self.branches, self.n_head, out.shape[-1]).astype(jnp.float32)
        return (out.sum(axis=2) * self.branch_scale).astype(self.dtype)

    def attend(self, x: jax.Array, positions: jax.Array, kv: KVCache, mask: jax.Array | None) -> jax.Array:
        """Training over fresh entries: each block's latent up-projected to per-head keys and values."""
        return self.run_blocks("train", self.queries(x, positions), kv, mask)

    def write_and_attend(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        mask: jax.Array,
        index: jax.Array,
        plans: dict,
        absorbed: bool,
    ) -> tuple[jax.Array, KVCache]:
        """Over the cache: prefill up-projects keys and values as training does; decode steps absorb the weights
        (paper Steps 1-3) and form no per-head key or value."""
        queries, cache = self.written_queries(x, positions, cache, index, plans, absorbed)
        return self.run_blocks("decode" if absorbed else "prefill", queries, cache, mask), cache

    def written_queries(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, index: jax.Array, plans: dict, absorbed: bool
    ) -> tuple[tuple[jax.Array, jax.Array], KVCache]:
        """x's entries stored in the cache at `index`, and x's queries (q_nope, q_rope)."""
        c_q, (latent, k_rope) = self.q_projection(x), self.kv_projections(x)
        cache = store_entry(cache, self.entry_from(latent, k_rope, positions), index, plans)
        if absorbed and tensor_size() == 1:  # one row: q_up and W_UK on its copies (absorbed_blocks)
            c_q = row_copies(c_q)
        return self.queries_from(c_q, positions), cache

    def attend_and_project(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        mask: jax.Array,
        index: jax.Array,
        plans: dict,
        absorbed: bool,
    ) -> tuple[jax.Array, KVCache]:
        """Attention.attend_and_project; a decode step under TP with project_in_region runs the output projection
        on each device's branch sums and reduces the hidden state once (no reduce-scatter of the heads, no
        all-reduce after a row-parallel projection)."""
        tp = tensor_size()
        plan = LatentPlan(self.blocks, self.branches, self.n_head, tp) if tp > 1 else None
        if not (absorbed and self.project_in_region and plan is not None and plan.serves_every_head):
            return super().attend_and_project(x, positions, cache, mask, index, plans, absorbed)
        if self.gate_proj is not None:
            raise ValueError("project_in_region serves models without the output gate")
        queries, cache = self.written_queries(x, positions, cache, index, plans, absorbed)
        kv_up = self.kv_up[...].astype(self.dtype)
        out = self.tensor_parallel_blocks("decode", plan, queries, cache, kv_up, mask, self.o_proj[...])
        return out, cache

    def run_blocks(
        self, mode: Mode, queries: tuple[jax.Array, jax.Array], kv: KVCache, mask: jax.Array | None
    ) -> jax.Array:
        """Every latent block's attention from queries (q_nope, q_rope), locally or each device's blocks under
        TP; [B, T, h, d_h]."""
        q_nope, q_rope = queries
        tp = tensor_size()
        if tp == 1 and mode == "train" and (self.absorbed_training or self.kernel_takes(q_nope, kv, mask)):
            return self.absorbed_attention(q_nope, q_rope, kv["latent"], kv["k_rope"], mask)
        if tp == 1:
            return self.local_blocks(mode, queries, kv, self.up_weights(), mask)
        if mode == "train" and self.absorbed_training and self.impl == MLRA_KERNEL:
            raise tensor_parallel_error()
        plan = LatentPlan(self.blocks, self.branches, self.n_head, tp)
        return self.tensor_parallel_blocks(mode, plan, (q_nope, q_rope), kv, self.kv_up[...].astype(self.dtype), mask)

    def kernel_takes(self, q_nope: jax.Array, kv: KVCache, mask: jax.Array | None) -> bool:
        """Under latent_form="auto": whether attention_impl "auto" runs this training call on our MLRA kernel (then
        it trains absorbed; else expanded, with nothing logged about the absorbed form's choice)."""
        if not self.auto_form:
            return False
        return use_kernel(self.impl, self.branches, q_nope, kv["latent"], kv["k_rope"], mask is not None, quiet=True)

    def local_blocks(
        self,
        mode: Mode,
        queries: tuple[jax.Array, jax.Array],
        kv: KVCache,
        up: tuple[jax.Array, jax.Array],
        mask: jax.Array | None,
    ) -> jax.Array:
        """Every latent block's attention on one device, with up = (W_UK, W_UV) [n, R, H, d_h]: [B, T, h, d_h]."""
        q_nope, q_rope = queries
        out = self.blocks_fn(mode)(self.per_block(q_nope), self.per_block(q_rope), kv["latent"], kv["k_rope"], up, mask)
        return self.merge_branches(out)

    def up_weights(self) -> tuple[jax.Array, jax.Array]:
        """W_UK and W_UV [n, R, H, d_h] in the compute dtype."""
        return split_up(self.kv_up[...].astype(self.dtype), self.nope_dim)

    def blocks_fn(self, mode: Mode) -> Callable[..., jax.Array]:
        if mode == "decode":
            return self.absorbed_blocks
        return self.absorbed_train_blocks if mode == "train" and self.absorbed_training else self.attend_blocks

    def tensor_parallel_blocks(
        self,
        mode: Mode,
        plan: LatentPlan,
        queries: tuple[jax.Array, jax.Array],
        kv: KVCache,
        kv_up: jax.Array,
        mask: jax.Array | None,
        o_proj: jax.Array | None = None,
    ) -> jax.Array:
        """The blocks in one shard_map over `tensor`: device d runs its latent block(s), their kv_up slices and its
        cache slice from the heads it serves (`plan`); the branch outputs meet in one psum_scatter that leaves
        [B, T, h, d_h] split over heads for the row-parallel output projection. queries: q_nope, q_rope
        [B, T, h, D]; kv: fresh entries in training, else the stored cache. The specs and manual axes of each
        mode come from tensor_parallel's train_layout, prefill_layout and decode_layout. With o_proj (whole on
        every device; decode steps of a plan that serves every head on each device), each device projects its
        branch sums and one psum of [B, T, d] returns the attention's output."""
        latent = plan.units.store(kv["latent"], axis=2) if mode == "train" else kv["latent"]  # laid out as the cache
        stored_kv = (latent, kv["k_rope"])
        kv_up = plan.units.store(kv_up, axis=0)
        has_mask, ndims = mask is not None, (latent.ndim, kv_up.ndim)
        if mode == "train":
            layout = train_layout(plan, has_mask, ndims)
        elif mode == "prefill":
            layout = prefill_layout(plan, has_mask, ndims)
        else:
            batch = split_batch_axes(queries[0].shape[0])
            layout = decode_layout(plan, has_mask, ndims, batch, frozenset(automatic_axes()))
        queries = tuple(layout.widen(x, layout.queries) for x in queries)
        stored_kv = tuple(layout.widen(x, spec) for x, spec in zip(stored_kv, layout.stored_kv))
        mapped = jax.shard_map(
            functools.partial(self._blocks_on_device, mode, plan, layout),
            in_specs=(layout.queries, layout.stored_kv, layout.kv_up, layout.mask, P()),
            out_specs=layout.out if o_proj is None else P(layout.queries[0]),
            axis_names=set(layout.manual_axes),
            check_vma=False,
        )
        return mapped(queries, stored_kv, kv_up, mask, o_proj)

    def _blocks_on_device(
        self,
        mode: Mode,
        plan: LatentPlan,
        layout: RegionLayout,
        queries: tuple[jax.Array, jax.Array],
        stored_kv: tuple[jax.Array, jax.Array],
        kv_up: jax.Array,
        mask: jax.Array | None,
        o_proj: jax.Array | None,
    ) -> jax.Array:
        """The region's body on one device: its blocks' attention, their branches summed into their heads' places,
        reduced over `tensor` (in the compute dtype in decode steps, tensor_parallel.reduce_dtype); with o_proj,
        projected first and reduced as the hidden state [B, T, d]."""
        h, t, out_dtype = plan.heads, plan.tp, self.dtype
        queries = tuple(x.astype(out_dtype) for x in queries)
        stored_kv = tuple(x.astype(out_dtype) for x in stored_kv)
        device = jax.lax.axis_index(TENSOR)
        first = plan.first_block(device)
        head_start, width = plan.head_slice(device)

        def mine(x: jax.Array) -> jax.Array:  # this device's [B, T, local_blocks, width, D]
            if layout.heads_sharded_in:
                return x.reshape(x.shape[:2] + (plan.local_blocks, width, x.shape[-1]))
            blocks = jax.lax.dynamic_slice_in_dim(self.per_block(x), first, plan.local_blocks, axis=2)
            return jax.lax.dynamic_slice_in_dim(blocks, head_start, width, axis=3)

        up = kv_up if layout.kv_up_by_heads else jax.lax.dynamic_slice_in_dim(kv_up, head_start, width, axis=2)
        blocks_fn = self.blocks_fn(mode)
        out = blocks_fn(*map(mine, queries), *stored_kv, split_up(up, self.nope_dim), mask).astype(jnp.float32)
        if layout.heads_sharded_in:
            return out.reshape(out.shape[:2] + (-1, out.shape[-1])).astype(out_dtype)
        groups = plan.blocks // plan.branches
        full = jnp.zeros(out.shape[:2] + (h, out.shape[-1]), jnp.float32)
        for j in range(plan.local_blocks):  # add each local block's heads into their place among all heads
            start = ((first + j) % groups) * plan.block_heads + head_start
            current = jax.lax.dynamic_slice_in_dim(full, start, width, axis=2)
            full = jax.lax.dynamic_update_slice_in_dim(full, current + out[:, :, j], start, axis=2)
        full = full * self.branch_scale
        if o_proj is not None:
            hidden = einsum("bthk,hkd->btd", full.astype(out_dtype), o_proj.astype(out_dtype))
            return jax.lax.psum(hidden.astype(reduce_dtype(mode, out_dtype)), TENSOR).astype(out_dtype)
        full = full.astype(reduce_dtype(mode, out_dtype))
        if h % t == 0:
            return jax.lax.psum_scatter(full, TENSOR, scatter_dimension=2, tiled=True).astype(out_dtype)
        return jax.lax.psum(full, TENSOR).astype(out_dtype)

    def attend_blocks(
        self,
        q_nope: jax.Array,
        q_rope: jax.Array,
        latent: jax.Array,
        k_rope: jax.Array,
        up: tuple[jax.Array, jax.Array],
        mask: jax.Array | None,
    ) -> jax.Array:
        """q [B, T, n, H, .] over latent [B, S, n, R] of n blocks with up = (W_UK, W_UV) [n, R, H, d_h]."""
        # keys and values in two products rather than one sliced after: v comes out contiguous, as the fused
        # kernels want it
        k = self.per_head_keys(latent, k_rope, up[0])
        v = einsum("bsnr,nrhk->bsnhk", latent, up[1])
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        flat = lambda a: a.reshape(a.shape[:2] + (-1, a.shape[-1]))
        out = attention(flat(q), flat(k), flat(v), scale=self.softmax_scale, impl=self.impl, mask=mask)
        return out.reshape(q.shape[:-1] + (self.nope_dim,))

    def per_head_keys(self, latent: jax.Array, k_rope: jax.Array, w_uk: jax.Array) -> jax.Array:
        """Each head's key [k_nope || k_rope] [B, S, n, H, d_h + d_h^R] from latent [B, S, n, R], the roped key
        [B, S, 1, d_h^R] and W_UK [n, R, H, d_h]. With product keys, [latent_j || k_rope] times
        [[W_UK_j, 0], [0, I]]: the product writes the keys where the attention reads them, and its transpose
        takes their cotangent whole (the RoPE key's summed over the heads by the identity's columns)."""
        rope = self.rope_dim
        if not self.product_keys:
            k_nope = einsum("bsnr,nrhk->bsnhk", latent, w_uk)
            k_rope = jnp.broadcast_to(k_rope[:, :, :, None, :], k_nope.shape[:-1] + (rope,))
            return jnp.concatenate([k_nope, k_rope], axis=-1)
        blocks, _, heads, nope = w_uk.shape
        identity = jnp.broadcast_to(jnp.eye(rope, dtype=w_uk.dtype)[None, :, None, :], (blocks, rope, heads, rope))
        weights = jnp.concatenate(
            [
                jnp.pad(w_uk, ((0, 0), (0, 0), (0, 0), (0, rope))),
                jnp.pad(identity, ((0, 0), (0, 0), (0, 0), (nope, 0))),
            ],
            axis=1,
        )
        k_rope = jnp.broadcast_to(k_rope, latent.shape[:3] + (rope,)).astype(latent.dtype)  # each block's rows
        rows = jnp.concatenate([latent, k_rope], axis=-1)
        return einsum("bsnr,nrhk->bsnhk", rows, weights.astype(latent.dtype))

    def absorbed_attention(
        self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, mask: jax.Array | None
    ) -> jax.Array:
        """Training attention with absorbed weights on one device: q_nope [B, T, h, d_h] and q_rope [B, T, h,
        d_h^R] over latent [B, S, n, R] and k_rope [B, S, 1, d_h^R] -> [B, T, h, d_h], the branches summed.
        Each head's query meets W_UK of every block that serves it in one product (no copy of q per branch),
        and W_UV with the branch sum is one product over (block, rank), accumulated in float32 (merged_heads).
        The attention runs on our MLRA kernel where attention_impl takes it (attention.mlra_kernel), which takes
        the query side head-major ([G, H, B, T, C, R]): the products batched over the heads make and read it so,
        with no transposed copy; else on latent_heads_attention."""
        branches, groups, heads = self.branches, self.blocks // self.branches, self.block_heads
        b, t = q_nope.shape[:2]
        rank, nope, rope = self.block_rank, self.nope_dim, self.rope_dim
        w_uk, w_uv = (w.reshape(branches, groups, rank, heads, nope) for w in self.up_weights())
        kernel = use_kernel(self.impl, branches, q_nope, latent, k_rope, mask is not None)
        spec = "gibtcr" if kernel else "btcgir"  # q_latent's and z's axes
        q_latent = einsum(f"btgik,cgrik->{spec}", q_nope.reshape(b, t, groups, heads, nope), w_uk)
        q_rope = q_rope.reshape(b, t, groups, heads, rope)
        if kernel:
            # our MLRA kernel: each group's RoPE queries shared by its branches, never copied per block
            z = mlra_kernel_attention(
                *(x.astype(self.dtype) for x in (q_latent, q_rope, latent, k_rope[:, :, 0])),
                scale=self.softmax_scale,
                backward=self.mlra_backward,
            )
        else:
            q_rope = jnp.broadcast_to(q_rope[:, :, None], (b, t, branches, groups, heads, rope))
            per_block = lambda x: x.reshape(b, t, self.blocks, heads, x.shape[-1])
            z = self.latent_heads_attention(per_block(q_latent), per_block(q_rope), latent, k_rope, mask)
            z = z.reshape(b, t, branches, groups, heads, rank)
        out = merged_heads(z, w_uv, spec, self.branch_scale, self.dtype)
        return out.reshape(b, t, self.n_head, nope)

    def absorbed_train_blocks(
        self,
        q_nope: jax.Array,
        q_rope: jax.Array,
        latent: jax.Array,
        k_rope: jax.Array,
        up: tuple[jax.Array, jax.Array],
        mask: jax.Array | None,
    ) -> jax.Array:
        """attend_blocks with absorbed weights (a device's blocks under TP): q [B, T, n, H, .] over latent
        [B, S, n, R] with up = (W_UK, W_UV) [n, R, H, d_h] -> [B, T, n, H, d_h]."""
        w_uk, w_uv = up
        q_latent = einsum("btnhk,nrhk->btnhr", q_nope, w_uk)
        z = self.latent_heads_attention(q_latent, q_rope, latent, k_rope, mask)
        return einsum("btnhr,nrhk->btnhk", z, w_uv)

    def latent_heads_attention(
        self, q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, mask: jax.Array | None
    ) -> jax.Array:
        """Attention of the absorbed queries [q_latent || q_rope] [B, T, n, H, R + d_h^R] over n KV heads, block
        j's key [latent_j || k_rope] and value latent_j (latent [B, S, n, R], k_rope [B, S, 1, d_h^R]): GQA for
        the fused kernels, H query heads per KV head -> [B, T, n, H, R]."""
        b, t, n, heads, rank = q_latent.shape
        q = jnp.concatenate([q_latent.astype(self.dtype), q_rope.astype(self.dtype)], axis=-1)
        k = jnp.concatenate([latent, jnp.broadcast_to(k_rope, latent.shape[:2] + (n, self.rope_dim))], axis=-1)
        out = attention(
            q.reshape(b, t, n * heads, q.shape[-1]),
            k.astype(self.dtype),
            latent.astype(self.dtype),
            scale=self.softmax_scale,
            impl=self.impl,
            mask=mask,
        )
        return out.reshape(b, t, n, heads, rank)

    def absorbed_blocks(
        self,
        q_nope: jax.Array,
        q_rope: jax.Array,
        latent: jax.Array,
        k_rope: jax.Array,
        up: tuple[jax.Array, jax.Array],
        mask: jax.Array | None,
    ) -> jax.Array:
        """Step 1: W_UK into the query; Step 2: MQA over [k_rope || latent]; Step 3: W_UV after."""
        w_uk, w_uv = up
        rows = latent.shape[0]  # the queries may be copies of one row (layers.row_copies): attend with one
        q_latent = einsum("btnhk,nrhk->btnhr", q_nope, w_uk).astype(self.dtype)
        z = latent_attention(
            q_rope[:rows], q_latent[:rows], k_rope[:, :, 0], latent, scale=self.softmax_scale, mask=mask, impl=self.impl
        )
        if tensor_size() == 1:  # one row: W_UV, the branch sum and the output projection on its copies
            z = row_copies(z)
        return einsum("btnhr,nrhk->btnhk", z, w_uv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def merged_heads(z: jax.Array, w_uv: jax.Array, spec: str, scale: float, dtype: jnp.dtype) -> jax.Array:
    """The heads' output [B, T, G, H, d_h] of absorbed training attention: z (axes `spec`, over b, t, branches c,
    groups g, heads i and ranks r) times W_UV [C, G, R, H, d_h], summed over (branch, rank) in float32, scaled and
    rounded to `dtype`. Its backward runs in `dtype` (a bf16 step's products on bf16 operands): the output's
    cotangent times the scale, rounded to `dtype` (exact for the power-of-two scales; MLRA-2's 1/sqrt(2) rounds
    once more), where autodiff would carry it in float32 and run both gradient products in float32."""
    return _merged_heads_forward(z, w_uv, spec, scale, dtype)[0]


def _merged_heads_forward(z, w_uv, spec, scale, dtype):
    out = einsum(f"{spec},cgrik->btgik", z, w_uv, preferred_element_type=jnp.float32)
    return (out * scale).astype(dtype), (z, w_uv)


def _merged_heads_backward(spec, scale, dtype, residuals, cotangent):
    z, w_uv = residuals
    cotangent = (cotangent.astype(jnp.float32) * scale).astype(dtype)
    d_z = einsum(f"btgik,cgrik->{spec}", cotangent, w_uv, preferred_element_type=jnp.float32)
    d_w = einsum(f"{spec},btgik->cgrik", z, cotangent, preferred_element_type=jnp.float32)
    return d_z.astype(z.dtype), d_w.astype(w_uv.dtype)


merged_heads.defvjp(_merged_heads_forward, _merged_heads_backward)


def branch_scale(cfg: ModelConfig) -> float:
    """The scale of the sum over branches: 1/sqrt(branches), 1 without the latent scales."""
    return cfg.latent_layout[1] ** -0.5 if cfg.latent_scale else 1.0


def split_up(kv_up: jax.Array, nope_dim: int) -> tuple[jax.Array, jax.Array]:
    """(W_UK, W_UV) from kv_up [..., 2 d_h]."""
    return kv_up[..., :nope_dim], kv_up[..., nope_dim:]
