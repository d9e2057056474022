"""A latent-family block on a tensor-parallel mesh as one shard_map over the whole mesh: each device runs its share
of the layer from weights laid out for it, and the layer's only collectives are one all-reduce of the hidden state
after the attention and one after the MLP (as a Megatron layer).

Device d of `tensor` serves the latent blocks and heads that tensor_parallel.LatentPlan gives it. Its weights
(`region_weights`, stacked over a leading `tensor` axis, one slice per device):

* x_proj: q_down, the kv_down columns of its blocks and k_rope_proj as one product of the normed x (every device
  computes c_q and the RoPE key itself: no all-gather of queries);
* q_up and o_proj: the rows of the heads its blocks serve (all heads for MLRA at TP <= branches, a slice
  otherwise), so that each device projects its branch sums to a partial of the hidden state;
* kv_up head-major [2, local blocks, heads, R, d_h] and its blocks' kv_norm scales; the output gate's heads;
* the MLP's gate_up [d, 2, f / tp] and down_proj [f / tp, d] (column- then row-parallel).

Where a device serves one latent block of rank R <= d_h and no output gate (MLRA-4 at TP=4 and 8, MLRA-2 and GLA-4
at TP=4), decode steps run on absorbed weights folded at load time (`folds`): W_UK into q_up, whose product is then
the latent query itself, and the branch scale times W_UV into o_proj, which then projects the attention's latent
output. This drops two products and their layout kernels per layer at no more bytes (q_up's and o_proj's shapes,
with R for d_h); prefill chunks read the weights as trained, held beside them under PREFILL_ONLY. The folded
products round once where the unfolded ones round at the query and at the branch sum.

The queries are computed once per distinct group of heads on the device (`slots`): MLRA's branches on one device
share them, and their outputs are summed into them before the output projection. The batch splits over the
data-parallel axes where it divides; the cache is read and written where it is stored (its latent split over
`tensor` as planned, the RoPE key on every device).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mlra_jax.attention.base import KVCache
from mlra_jax.attention.core import latent_attention
from mlra_jax.attention.latent import LatentAttention, branch_scale
from mlra_jax.attention.rope import apply_rope
from mlra_jax.config import ModelConfig
from mlra_jax.decode import layouts, serving_block
from mlra_jax.layers import project, rms_norm, row_copies
from mlra_jax.peer_exchange import axis_all_reduce
from mlra_jax.sharding import split_batch_axes
from mlra_jax.tensor_parallel import TENSOR, LatentPlan, reduce_dtype

Weights = dict[str, jax.Array]
# Latent-family models on a mesh with `tensor` > 1 serve through this module; False runs the modules as trained
# under GSPMD (their TP regions cover the attention core only).
REGION_BLOCKS = True
# Decode steps of the plans that `folds` admits run on W_UK folded into q_up and W_UV into o_proj; False keeps them
# apart (benchmarks' --absorbed_weights=separate).
FOLD_ABSORBED = True
PREFILL_ONLY = "prefill"  # the key of the weights as trained beside folded ones, which decode steps do not read


def serves(cfg: ModelConfig, mesh: jax.sharding.Mesh | None) -> bool:
    """Whether the serving layer runs `cfg`'s blocks as regions on `mesh` (latent family, tensor > 1)."""
    return REGION_BLOCKS and mesh is not None and mesh.shape.get(TENSOR, 1) > 1 and cfg.spec.latent_layout is not None


def plan_of(cfg: ModelConfig, tp: int) -> LatentPlan:
    """Which latent blocks and heads each device of a TP degree `tp` serves."""
    blocks, branches = cfg.latent_layout
    return LatentPlan(blocks, branches, cfg.n_head, tp)


def slots(plan: LatentPlan) -> int:
    """Distinct groups of heads among a device's blocks: its consecutive blocks cycle through the groups, so local
    block j serves the heads of slot j % slots (blocks and TP degrees are powers of two)."""
    return min(plan.local_blocks, plan.blocks // plan.branches)


def folds(cfg: ModelConfig, plan: LatentPlan) -> bool:
    """Whether decode steps run on folded absorbed weights: one latent block per device of rank at most d_h (so the
    folded q_up and o_proj are no larger than the trained ones) and no output gate between W_UV and o_proj."""
    rank, nope = cfg.kv_lora_rank // plan.blocks, cfg.qk_nope_head_dim
    return FOLD_ABSORBED and plan.local_blocks == 1 and rank <= nope and not cfg.gated


def folded(weights: Weights, nope_dim: int, branch_scale: float) -> Weights:
    """One device's decode weights with W_UK folded into q_up ([..., q, H, R + d_h^R]: the latent query and the RoPE
    query) and branch_scale x W_UV into o_proj ([..., H, R, d]), products in float32 rounded once; the trained
    q_up, kv_up and o_proj under PREFILL_ONLY."""
    q_up, o_proj = weights["q_up"], weights["o_proj"]
    w_uk, w_uv = weights["kv_up"][..., 0, 0, :, :, :], weights["kv_up"][..., 1, 0, :, :, :]  # [.., H, R, d_h]
    f32 = lambda a: a.astype(jnp.float32)
    q_latent = jnp.einsum("...qhk,...hrk->...qhr", f32(q_up[..., :nope_dim]), f32(w_uk))
    q_absorbed = jnp.concatenate([q_latent.astype(q_up.dtype), q_up[..., nope_dim:]], axis=-1)
    o_absorbed = branch_scale * jnp.einsum("...hrk,...hkd->...hrd", f32(w_uv), f32(o_proj))
    prefill = {name: weights[name] for name in ("q_up", "kv_up", "o_proj")}
    rest = {name: a for name, a in weights.items() if name not in prefill}
    return {**rest, "q_up": q_absorbed, "o_proj": o_absorbed.astype(o_proj.dtype), PREFILL_ONLY: prefill}


def decode_read(tree: Any) -> Any:
    """A tree of serving weights without those that only prefill chunks read (PREFILL_ONLY): what decode steps read."""
    if isinstance(tree, dict):
        return {k: decode_read(v) for k, v in tree.items() if k != PREFILL_ONLY}
    if isinstance(tree, (list, tuple)):
        return type(tree)(decode_read(v) for v in tree)
    return tree


def device_tables(plan: LatentPlan) -> tuple[np.ndarray, np.ndarray]:
    """Per device d: its blocks [tp, local_blocks] and the heads of its slots [tp, slots * width], slot-major."""
    groups, g = plan.blocks // plan.branches, slots(plan)
    blocks, heads = [], []
    for d in range(plan.tp):
        first = plan.first_block(d)
        start, width = plan.head_slice(d)
        blocks.append([first + j for j in range(plan.local_blocks)])
        heads.append([((first + s) % groups) * plan.block_heads + start + i for s in range(g) for i in range(width)])
    return np.asarray(blocks), np.asarray(heads)


def region_weights(blocks: Weights, cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Weights:
    """The per-device weights of the blocks (stacked over layers: [L, ...]; the MLP padded, decode.layouts), each
    device's attention weights stacked on an axis after the layers' and split over `tensor`; the MLP's weights split
    over `tensor` along the hidden width. Laid out in one jitted call, in which each device computes its own slices
    (no stack is held whole on any device)."""
    plan = plan_of(cfg, mesh.shape[TENSOR])
    block_table, head_table = device_tables(plan)
    _, width = plan.head_slice(0)

    def for_device(attn: Weights, d: int) -> Weights:
        local, heads = jnp.asarray(block_table[d]), jnp.asarray(head_table[d])
        start, _ = plan.head_slice(d)
        kv_down = jnp.take(attn["kv_down"], local, axis=-2)
        x_proj = [attn["q_down"], kv_down.reshape(kv_down.shape[:-2] + (-1,)), attn["k_rope_proj"]]
        up = jax.lax.slice_in_dim(jnp.take(attn["kv_up"], local, axis=-4), start, start + width, axis=-2)
        weights = {
            "x_proj": jnp.concatenate(x_proj, axis=-1),
            "q_up": jnp.take(attn["q_up"], heads, axis=-2),
            "kv_up": layouts.head_major(up),
            "kv_norm": jnp.take(attn["kv_norm"]["scale"], local, axis=-2),
            "o_proj": jnp.take(attn["o_proj"], heads, axis=-3),
        }
        if "gate_proj" in attn:
            weights["gate_proj"] = jnp.take(attn["gate_proj"], heads, axis=-2)
        if folds(cfg, plan):
            return folded(weights, cfg.qk_nope_head_dim, branch_scale(cfg))
        return weights

    def laid_out(attn: Weights, mlp: Weights) -> Weights:
        per_device = [for_device(attn, d) for d in range(plan.tp)]
        stacked = jax.tree.map(lambda *a: jnp.stack(a, axis=1), *per_device)  # [L, tp, ...]
        split = lambda a, *spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))
        gate_up = jnp.stack([mlp["gate_proj"], mlp["up_proj"]], axis=-2)  # [L, d, 2, f]
        return {
            "attn": jax.tree.map(lambda a: split(a, None, TENSOR), stacked),
            "mlp": {
                "gate_up": split(gate_up, None, None, None, TENSOR),
                "down_proj": split(mlp["down_proj"], None, TENSOR),
            },
        }

    return jax.jit(laid_out)(blocks["attn"], blocks["mlp"])


# What region_weights lays out beyond the attention weights that decode.layouts holds for one device: the blocks
# run on layouts.serving_shell(block, ALSO_HELD) and its layouts.module_weights(blocks, ALSO_HELD).
ALSO_HELD = ("gate_proj",)


def block_step(
    block_def: nnx.GraphDef,
    weights: Weights,
    x: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    mask: jax.Array,
    index: jax.Array,
    plans: dict,
    absorbed: bool,
    mesh: jax.sharding.Mesh,
) -> tuple[jax.Array, KVCache]:
    """New tokens x [B, T, d] through one block (weights: {"block": layouts.module_weights(.., ALSO_HELD),
    "region": region_weights of the layer}): their entries written into the cache at `index`, attention over it;
    a decode step with absorbed, else a prefill chunk."""
    batch = split_batch_axes(x.shape[0]) or None
    lead = P(batch)
    cache_specs = {name: plans[name].spec(cache[name].ndim, 2, leading=(batch,)) for name in cache}
    region = weights["region"]
    specs = (
        P(),  # the shell's weights
        {
            "attn": jax.tree.map(lambda _: P(TENSOR), region["attn"]),
            "mlp": {"gate_up": P(None, None, TENSOR), "down_proj": P(TENSOR)},
        },
        lead,
        lead,
        cache_specs,
        lead,
        P(),
    )
    reduce = axis_all_reduce(mesh, TENSOR)
    body = functools.partial(_on_device, block_def, absorbed, mesh.shape[TENSOR], reduce)
    mapped = jax.shard_map(
        body, in_specs=specs, out_specs=(lead, cache_specs), axis_names=set(mesh.axis_names), check_vma=False
    )
    return mapped(weights["block"], region, x, positions, cache, mask, index)


def _on_device(
    block_def: nnx.GraphDef,
    absorbed: bool,
    tp: int,
    reduce: Callable[[jax.Array], jax.Array],
    module: Weights,
    region: Weights,
    x: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    mask: jax.Array,
    index: jax.Array,
) -> tuple[jax.Array, KVCache]:
    """block_step's body on one device: its shard of the batch, its slice of the stacked weights and of the cache."""
    block = nnx.merge(block_def, module)
    attn: LatentAttention = block.attn
    held = jax.tree.map(lambda a: a[0], region["attn"])  # this device's slice of the stacked weights
    mode = "decode" if absorbed else "prefill"
    prefill = held.pop(PREFILL_ONLY, None)  # the weights as trained, where decode steps run on folded ones
    fold = absorbed and prefill is not None
    if not absorbed and prefill is not None:
        held |= prefill
    plan = LatentPlan(attn.blocks, attn.branches, attn.n_head, tp)
    n, g = plan.local_blocks, slots(plan)
    dtype = attn.dtype

    h = block.attn_norm(x)
    y = project(h, held["x_proj"], "btd,dk->btk", dtype)
    c_q, latent, k_rope = jnp.split(y, (attn.q_rank, attn.q_rank + n * attn.block_rank), axis=-1)
    latent = latent.reshape(latent.shape[:-1] + (n, attn.block_rank))
    entry = {
        "latent": (rms_norm(latent, held["kv_norm"], attn.kv_norm.eps) * attn.kv_scale).astype(dtype),
        "k_rope": apply_rope(k_rope, positions, attn.theta)[:, :, None, :].astype(dtype),
    }
    cache = {
        name: jax.lax.dynamic_update_slice_in_dim(cache[name], entry[name].astype(cache[name].dtype), index, axis=1)
        for name in cache
    }
    if absorbed:  # one row: q_up and W_UK on its copies (LatentAttention.absorbed_blocks)
        c_q = row_copies(c_q)
    if fold:
        hidden = _folded_attention(attn, held, c_q, positions, cache, mask)[: x.shape[0]]
    else:
        hidden = _attention(attn, held, h, c_q, positions, cache, mask, mode, n, g)[: x.shape[0]]
    x = x + _reduced(hidden, mode, dtype, reduce)
    mlp = serving_block.swiglu(region["mlp"], block.mlp_norm(x), False, dtype)
    return x + _reduced(mlp, mode, dtype, reduce), cache


def _folded_attention(
    attn: LatentAttention, held: Weights, c_q: jax.Array, positions: jax.Array, cache: KVCache, mask: jax.Array
) -> jax.Array:
    """A decode step's attention output [B, T, d] (partial over `tensor`) on the folded weights (`folded`): the
    latent query straight from q_up, the latent output straight into o_proj."""
    q = project(attn.normed_query(c_q), held["q_up"], "btq,qhk->bthk", attn.dtype)
    rank, rows = attn.block_rank, cache["latent"].shape[0]  # the query may be copies of one row: attend with one
    q_latent, q_rope = q[:rows, :, None, :, :rank], apply_rope(q[:rows, :, None, :, rank:], positions, attn.theta)
    z = latent_attention(
        q_rope, q_latent, cache["k_rope"][:, :, 0], cache["latent"], scale=attn.softmax_scale, mask=mask, impl=attn.impl
    )
    return project(z[:, :, 0], held["o_proj"], "bthr,hrd->btd", attn.dtype)


def _attention(
    attn: LatentAttention,
    held: Weights,
    h: jax.Array,
    c_q: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    mask: jax.Array,
    mode: str,
    n: int,
    g: int,
) -> jax.Array:
    """The attention output [B, T, d] (partial over `tensor`) on the weights as trained: the device's n blocks over
    its g slots of heads, their branches summed before o_proj."""
    dtype = attn.dtype
    q_nope, q_rope = attn.split_query(project(attn.normed_query(c_q), held["q_up"], "btq,qhk->bthk", dtype), positions)
    width = q_nope.shape[2] // g

    def per_block(q: jax.Array) -> jax.Array:  # [B, T, g * width, D] -> [B, T, n, width, D]: block j reads slot j % g
        q = q.reshape(q.shape[:2] + (1, g, width, q.shape[-1]))
        return jnp.broadcast_to(q, q.shape[:2] + (n // g,) + q.shape[3:]).reshape(q.shape[:2] + (n, width, -1))

    up = serving_block.absorbed_up(held["kv_up"], dtype)
    out = attn.blocks_fn(mode)(per_block(q_nope), per_block(q_rope), cache["latent"], cache["k_rope"], up, mask)
    out = out.astype(jnp.float32)
    out = out.reshape(out.shape[:2] + (n // g, g * width, out.shape[-1])).sum(axis=2) * attn.branch_scale
    out = out.astype(dtype)
    if "gate_proj" in held:
        out = out * jax.nn.sigmoid(project(h, held["gate_proj"], "btd,dhk->bthk", dtype))
    return project(out, held["o_proj"], "bthk,hkd->btd", dtype)


def _reduced(partial: jax.Array, mode: str, dtype: jnp.dtype, reduce: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The sum over `tensor` of each device's partial of the hidden state (in the compute dtype in decode steps,
    tensor_parallel.reduce_dtype), by `reduce` (peer_exchange.axis_all_reduce: the peer kernel or psum)."""
    return reduce(partial.astype(reduce_dtype(mode, dtype))).astype(dtype)
