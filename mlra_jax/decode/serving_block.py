"""A block's prefill chunk or decode step on XLA over the serving weights (decode.layouts): the module path's
math (model.Block.cached) with the products of the held weights in their serving layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlra_jax.attention.base import Attention, store_entry
from mlra_jax.attention.latent import LatentAttention
from mlra_jax.layers import project, row_copies
from mlra_jax.model import Block

Weights = dict[str, jax.Array]


def block_step(
    block: Block,
    held: Weights,
    x: jax.Array,
    positions: jax.Array,
    cache: dict[str, jax.Array],
    mask: jax.Array,
    index: jax.Array,
    plans: dict,
    absorbed: bool,
    out_major: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """New tokens x [B, T, d] through `block` (a serving shell, layouts.serving_shell) and its held weights
    {"attn", "mlp"} (layouts.held_weights): their entries written into the cache at `index`, attention over it."""
    h = block.attn_norm(x)
    if isinstance(block.attn, LatentAttention):
        heads, cache = latent_heads(
            block.attn, held["attn"], h, positions, cache, mask, index, plans, absorbed, out_major
        )
    else:
        heads, cache = block.attn.write_and_attend(h, positions, cache, mask, index, plans, absorbed)
    x = x + output(block.attn, held["attn"]["o_proj"], h, heads, out_major)
    return x + swiglu(held["mlp"], block.mlp_norm(x), out_major, block.attn.dtype), cache


def latent_heads(
    attn: LatentAttention,
    held: Weights,
    x: jax.Array,
    positions: jax.Array,
    cache: dict[str, jax.Array],
    mask: jax.Array,
    index: jax.Array,
    plans: dict,
    absorbed: bool,
    out_major: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """LatentAttention.write_and_attend over the held x_proj, q_up and head-major kv_up: the heads' output
    [B, T, h, d_h] and the cache."""
    y = project(x, held["x_proj"], "btd,kd->btk" if out_major else "btd,dk->btk", attn.dtype)
    c_q, latent, k_rope = jnp.split(y, (attn.q_rank, attn.q_rank + attn.blocks * attn.block_rank), axis=-1)
    latent = latent.reshape(latent.shape[:-1] + (attn.blocks, attn.block_rank))
    cache = store_entry(cache, attn.entry_from(latent, k_rope, positions), index, plans)
    if absorbed:  # one row: q_up and W_UK on its copies (absorbed_blocks)
        c_q = row_copies(c_q)
    q_spec = "btq,hkq->bthk" if out_major else "btq,qhk->bthk"
    queries = attn.split_query(project(attn.normed_query(c_q), held["q_up"], q_spec, attn.dtype), positions)
    up = absorbed_up(held["kv_up"], attn.dtype)
    return attn.local_blocks("decode" if absorbed else "prefill", queries, cache, up, mask), cache


def absorbed_up(kv_up: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(W_UK, W_UV) [n, R, H, d_h] in `dtype` from the head-major kv_up [2, n, H, R, d_h] (layouts.head_major), as
    the latent blocks take them."""
    kv_up = kv_up.astype(dtype)
    return jnp.swapaxes(kv_up[0], 1, 2), jnp.swapaxes(kv_up[1], 1, 2)


def output(attn: Attention, o_proj: jax.Array, x: jax.Array, heads_out: jax.Array, out_major: bool) -> jax.Array:
    """Attention.output with the held o_proj."""
    spec = "bthk,dhk->btd" if out_major else "bthk,hkd->btd"
    return project(attn.gated(x, heads_out), o_proj, spec, attn.dtype)[: x.shape[0]]


def swiglu(held: Weights, x: jax.Array, out_major: bool, dtype: jnp.dtype) -> jax.Array:
    """layers.MLP over the held gate_up and down_proj."""
    rows = x.shape[0]
    x = row_copies(x)
    both = project(x, held["gate_up"], "btd,gfd->btgf" if out_major else "btd,dgf->btgf", dtype)
    down_spec = "btf,df->btd" if out_major else "btf,fd->btd"
    return project(jax.nn.silu(both[:, :, 0]) * both[:, :, 1], held["down_proj"], down_spec, dtype)[:rows]
