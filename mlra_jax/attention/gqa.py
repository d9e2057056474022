"""MHA, MQA and GQA (reference model/mha.py, model/gqa.py): RoPE on the full head,
KV head i // group_size serves query head i. MHA is group_size 1, MQA group_size n_head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mlra_jax.attention import gqa_kernel
from mlra_jax.attention.base import Attention, CacheComponent, DecodeShape, KVCache, store_entry
from mlra_jax.attention.core import MASKED, attention
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.layers import dense_init, einsum, make_param, project
from mlra_jax.tensor_parallel import TENSOR, UnitPlan, tensor_size


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
        return [
            CacheComponent(name, cfg.n_kv_head, (cfg.head_dim,), "kv_heads", read_by_heads=cfg.n_head)
            for name in ("k", "v")
        ]

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
        return attention(self.queries(x, positions), kv["k"], kv["v"], scale=self.scale, impl=self.impl, mask=mask)

    def queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rope(project(x, self.q_proj, "btd,dhk->bthk", self.dtype), positions, self.theta)

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
        """Attention.write_and_attend; under TP, where each device stores the KV heads its query heads read
        (reads_cache_as_stored), each device attends over the KV heads it stores (aligned_attention). Decode
        steps that take the Pallas kernel (attention_impl "pallas" on NVIDIA GPUs: attention.gqa_kernel) run it
        over the cache as stored, under TP each device over its own KV heads."""
        plan = plans["k"]
        q_shape = jax.ShapeDtypeStruct((*x.shape[:2], self.n_head, cache["k"].shape[-1]), self.dtype)
        if gqa_kernel.use_kernel(self.impl, q_shape, cache["k"], plan):
            cache = store_entry(cache, self.cache_entry(x, positions), index, plans)
            q = self.queries(x, positions)
            return gqa_kernel.gqa_decode_attention(q, cache["k"], cache["v"], mask, plan, self.scale), cache
        if not reads_cache_as_stored(plan, x.shape[1]):
            return super().write_and_attend(x, positions, cache, mask, index, plans, absorbed)
        cache = store_entry(cache, self.cache_entry(x, positions), index, plans)
        return aligned_attention(self.queries(x, positions), cache["k"], cache["v"], mask, plan, self.scale), cache


# Most KV heads per device that one product over the cache as stored takes in a decode step: it scores every local
# query head against every local KV head, so its score FLOPs grow with them (decode steps stay far below the ridge)
MAX_SLOTS_READ_AS_STORED = 4


def reads_cache_as_stored(plan: UnitPlan, new_tokens: int) -> bool:
    """Whether aligned_attention serves this step: always for aligned plans (their KV heads are stored as the query
    heads read them); for KV heads split or spread over `tensor`, in decode steps of at most
    MAX_SLOTS_READ_AS_STORED KV heads per device, where XLA's grouped product would copy the cache transposed."""
    if tensor_size() != plan.tp or not plan.heads or plan.heads % plan.tp:
        return False
    if plan.aligned:
        return True
    return plan.sharded and new_tokens == 1 and plan.per_device <= MAX_SLOTS_READ_AS_STORED


def aligned_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, plan: UnitPlan, scale: float
) -> jax.Array:
    """GQA over a cache whose devices store the KV heads their query heads read, in one shard_map over `tensor`:
    q [B, T, h, D] split over heads, k and v [B, S, stored, D] split over their slots, mask [B, T, S] ->
    [B, T, h, D] split over heads. Each device
    scores its query heads against each of its k stored KV heads and masks the pairs that GQA does not pair
    (UnitPlan.local_heads_slot), so one softmax over (slot, key) is each head's softmax over its own KV head: the
    cache is read as stored, with no gather and no transposed copy, for k times the scores' FLOPs."""
    reads = jnp.asarray(plan.local_heads_slot)  # [tp, h / tp]

    def on_device(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        paired = reads[jax.lax.axis_index(TENSOR)][:, None] == jnp.arange(k.shape[2])[None, :]  # [h / tp, k]
        return attend_as_stored(q, k, v, mask, paired, scale)

    heads = P(None, None, TENSOR, None)
    return jax.shard_map(
        on_device, in_specs=(heads, heads, heads, P()), out_specs=heads, axis_names={TENSOR}, check_vma=False
    )(q, k, v, mask)


def attend_as_stored(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, paired: jax.Array, scale: float
) -> jax.Array:
    """One device's part of aligned_attention (XLA): q [B, T, h, D], k and v [B, S, slots, D], mask [B, T, S],
    paired [h, slots] (which stored KV head each query head reads) -> [B, T, h, D]."""
    (b, t, h, d), (s, slots) = q.shape, k.shape[1:3]
    # (query, head) rows against (slot, KV head) rows: batched products of the cache as stored (a KV head axis
    # between the slots and the width would otherwise be transposed out of the whole cache)
    rows = (b, t * h, d)
    keys = k.reshape(b, s * slots, d)
    logits = einsum("bqd,bnd->bqn", q.reshape(rows), keys, preferred_element_type=jnp.float32)
    logits = logits.reshape(b, t, h, s, slots) * scale
    logits = jnp.where(paired[None, None, :, None, :] & mask[:, :, None, :, None], logits, MASKED)
    probs = jax.nn.softmax(logits.reshape(b, t * h, s * slots), axis=-1).astype(v.dtype)
    out = einsum("bqn,bnd->bqd", probs, v.reshape(b, s * slots, d), preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(v.dtype)
