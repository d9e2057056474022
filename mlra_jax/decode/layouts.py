"""The weights a single device's decode steps read, laid out for them by pure functions of the trained
parameters (stacked over layers or not: every axis is counted from the end).

The serving layer holds these itself (`held_weights`); the modules it runs (`serving_shell`) keep only what
they read in their own layout (norm scales, the gate, the attention of the variants without a latent):

* the MLP's hidden width padded with zeros to a multiple of 128 (`padded_mlp`), which XLA's Triton GEMMs read as
  stored;
* the SwiGLU's gate_proj and up_proj as one `gate_up` [d, 2, f]: one product of x instead of two, as XLA's
  DotMerger would make it by copying both on every call (serving turns that pass off);
* the latent family's q_down, kv_down and k_rope_proj as one `x_proj` [d, d_c' + n R + d_h^R], for the same
  reason: each of the three at batch 1 takes about twice its bytes' time;
* the latent family's kv_up as W_UK and W_UV, each head-major, `kv_up` [2, n, H, R, d_h]: the absorbed
  products batch over block and head, which the parameter's [n, R, H, 2 d_h] interleaves with the rank, so
  XLA copies a transposed W_UK and W_UV out of it on every decode step (H100, 2.9B MLRA-4 at batch 1: 6.4 us
  of a layer's 132);
* on a mesh, MLRA's q_up whole on every device of `tensor`, and o_proj too where each device serves every head
  (`tensor_parallel_weights`): no all-gather of the queries, one all-reduce per attention;
* out_major: every product's weight stored [out, in] (gate_up [2, f, d], down_proj [d, f], o_proj [d, h, d_v],
  x_proj [d_c' + n R + d_h^R, d], q_up [h, d_h + d_h^R, d_c']), the layout of the batch-1 row kernels
  (decode.row_step), which the XLA steps of the same model read as well.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mlra_jax.attention.latent import LatentAttention
from mlra_jax.config import ModelConfig
from mlra_jax.model import Block
from mlra_jax.sharding import without_axis
from mlra_jax.tensor_parallel import TENSOR, LatentPlan

Weights = dict[str, jax.Array]
# The MLP's hidden width in serving weights is padded with zeros to a multiple of this (padded_mlp).
MLP_MULTIPLE = 128
LATENT_HELD = ("q_down", "kv_down", "k_rope_proj", "q_up", "kv_up")  # the latent attention's held weights


def is_latent(attn: Weights) -> bool:
    """Whether attention parameters are the latent family's."""
    return "kv_up" in attn


def mlp_weights(mlp: Weights, out_major: bool) -> Weights:
    """gate_up [d, 2, f] (out_major: [2, f, d]) and down_proj [f, d] (out_major: [d, f])."""
    gate_up = jnp.stack([mlp["gate_proj"], mlp["up_proj"]], axis=-2)
    down = mlp["down_proj"]
    if out_major:
        gate_up, down = jnp.moveaxis(gate_up, -3, -1), jnp.swapaxes(down, -1, -2)
    return {"gate_up": gate_up, "down_proj": down}


def attention_weights(attn: Weights, out_major: bool) -> Weights:
    """o_proj [h, d_v, d] (out_major: [d, h, d_v]); for the latent family also x_proj, q_up and head-major kv_up."""
    o_proj = attn["o_proj"]
    held = {"o_proj": jnp.moveaxis(o_proj, -1, -3) if out_major else o_proj}
    if not is_latent(attn):
        return held
    kv_down, up = attn["kv_down"], attn["kv_up"]
    x_proj = jnp.concatenate([attn["q_down"], kv_down.reshape(kv_down.shape[:-2] + (-1,)), attn["k_rope_proj"]], -1)
    q_up = attn["q_up"]
    if out_major:
        x_proj, q_up = jnp.swapaxes(x_proj, -1, -2), jnp.moveaxis(q_up, -3, -1)
    return {**held, "x_proj": x_proj, "q_up": q_up, "kv_up": head_major(up)}


def head_major(kv_up: jax.Array) -> jax.Array:
    """kv_up [..., n, R, H, 2 d_h] as W_UK and W_UV, each head-major: [..., 2, n, H, R, d_h]."""
    split = kv_up.reshape(kv_up.shape[:-1] + (2, kv_up.shape[-1] // 2))  # [..., n, R, H, 2, d_h]
    return jnp.moveaxis(split, (-2, -5, -3, -4), (-5, -4, -3, -2))


def held_weights(blocks: Weights, out_major: bool) -> Weights:
    """What the serving layer holds in its own layouts: {"attn": attention_weights, "mlp": mlp_weights}."""
    return {"attn": attention_weights(blocks["attn"], out_major), "mlp": mlp_weights(blocks["mlp"], out_major)}


def module_weights(blocks: Weights, also: tuple[str, ...] = ()) -> Weights:
    """The block parameters the serving shell's modules keep (their own layout): all but the held ones and the
    attention's `also`."""
    dropped = (("o_proj", *LATENT_HELD) if is_latent(blocks["attn"]) else ("o_proj",)) + also
    attn = {name: a for name, a in blocks["attn"].items() if name not in dropped}
    return {name: a for name, a in blocks.items() if name != "mlp"} | {"attn": attn}


def serving_shell(block: Block, also: tuple[str, ...] = ()) -> Block:
    """A copy of `block` without the weights held in serving layouts and the attention's `also` (module_weights'
    structure): its norms, gate and (other than the latent family) attention run as trained; the serving steps
    read the rest."""
    shell = nnx.clone(block)
    shell.mlp = None
    shell.attn.o_proj = None
    held = (*LATENT_HELD, *also) if isinstance(shell.attn, LatentAttention) else also
    for name in held:
        setattr(shell.attn, name, None)
    return shell


def padded_mlp(mlp: dict[str, jax.Array], multiple: int = MLP_MULTIPLE) -> dict[str, jax.Array]:
    """The SwiGLU's weights (stacked over layers or not) with its hidden width padded with zeros to a
    multiple of `multiple`: the same output (a padded unit's gate and up are 0, and silu(0) * 0 = 0 meets
    zero rows of down_proj), and weights that XLA's Triton GEMMs read as stored. They pad an odd width
    (9880 in the 2.9B models) on every call: H100, 2.9B MLRA-4 at 8K tokens, 1 ms of each step (the
    profile's "loop_pad_fusion")."""
    width = mlp["down_proj"].shape[-2]
    extra = -width % multiple
    if not extra:
        return mlp

    def pad(a: jax.Array, axis: int) -> jax.Array:
        padded = jnp.pad(a, [(0, extra if i == axis % a.ndim else 0) for i in range(a.ndim)])
        if isinstance(a, jax.core.Tracer) or not isinstance(a.sharding, jax.sharding.NamedSharding):
            return padded  # traced (tpu_compile): GSPMD places it; unsharded: where it is
        return jax.device_put(padded, a.sharding)

    return {
        **mlp,
        "gate_proj": pad(mlp["gate_proj"], -1),
        "up_proj": pad(mlp["up_proj"], -1),
        "down_proj": pad(mlp["down_proj"], -2),
    }


# Decode steps of MLRA on a mesh project the heads' output inside the blocks' region where they can
# (projects_in_region); False keeps the reduce-scatter of the heads into the row-parallel o_proj.
PROJECT_IN_REGION = True


def projects_in_region(cfg: ModelConfig, tp: int) -> bool:
    """Whether decode steps at TP degree `tp` project the latent heads' output inside the blocks' region
    (LatentAttention.project_in_region): MLRA where every device serves every head, without the output gate."""
    layout = cfg.spec.latent_layout
    if not PROJECT_IN_REGION or tp == 1 or layout is None or cfg.gated:
        return False
    return LatentPlan(*layout, cfg.n_head, tp).serves_every_head


def whole_along_tensor(a: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """`a` whole on every device of `tensor`, split as before over the other axes (under a trace, as preparing
    serving weights inside jit does: replicated)."""
    try:
        sharding = a.sharding
    except AttributeError:  # a tracer: its sharding is GSPMD's to choose
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, PartitionSpec()))
    return jax.device_put(a, without_axis(sharding, TENSOR))


def tensor_parallel_weights(blocks: Weights, cfg: ModelConfig, mesh: jax.sharding.Mesh) -> Weights:
    """The blocks' weights (sharded arrays on `mesh`) as MLRA's decode steps read them: q_up whole
    on every device of `tensor` where the latent blocks serve several branches (every device projects all heads'
    queries from its whole c_q, a small share of a layer's weights, instead of all-gathering the head-sharded
    q_nope and q_rope in every layer), and o_proj whole where the heads' output is projected in the region
    (projects_in_region: one all-reduce per attention instead of a reduce-scatter and an all-reduce)."""
    layout, tp = cfg.spec.latent_layout, mesh.shape.get(TENSOR, 1)
    if tp == 1 or layout is None or layout[1] == 1:
        return blocks
    whole = ("q_up", "o_proj") if projects_in_region(cfg, tp) else ("q_up",)
    attn = dict(blocks["attn"])
    for name in whole:
        attn[name] = whole_along_tensor(attn[name], mesh)
    return {**blocks, "attn": attn}
