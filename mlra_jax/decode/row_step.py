"""Batch-1 decode steps on the row-product kernels (GPUs; Pallas interpret mode on CPU for the tests).

At batch 1 every product of a decode step reads one row, and XLA runs the norms, residual adds, SwiGLU,
RoPE and cache writes between the products as kernels of their own: 24 kernels per 2.9B MLRA-4 layer on an
H100, 15 of them elementwise at 1.1-1.6 us each. Here a block is

* latent family: norm_matvec (attention norm, x's three projections) | norm_matvec (q_norm, q_up) |
  latent_queries (W_UK, RoPE, and the cache entry) | the attention (the Mosaic GPU kernel and its split-KV
  merge where they run) | latent_output (W_UV, the branch sum) | matvec_add (o_proj, residual) |
  swiglu_norm_matvec (MLP norm, gate and up, SwiGLU) | matvec_add (down, residual): 9 kernels;
* other variants: the attention as the module computes it, then the same output and MLP kernels;

and the tied head is norm_matvec with the final norm. The weights are the serving layer's, held out-major
([out, in]: decode.layouts with out_major). Every kernel rounds as the model does, so a step gives the
module path's logits up to the float32 summation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mlra_jax.attention.core import latent_attention
from mlra_jax.attention.latent import LatentAttention
from mlra_jax.attention.rope import rope_angles
from mlra_jax.config import ModelConfig
from mlra_jax.layers import RMSNorm
from mlra_jax.model import Block
from mlra_jax.pallas_kernels.latent_rows_gpu import LatentEntry, check_latent_shapes, latent_output, latent_queries
from mlra_jax.pallas_kernels.row_products_gpu import matvec_add, norm_matvec, swiglu_norm_matvec
from mlra_jax.platform import target_platform

ROW_KERNEL_MODES = ("auto", "on", "off", "interpret")


def row_kernels_problem(cfg: ModelConfig, mesh: jax.sharding.Mesh | None, interpret: bool = False) -> str | None:
    """Why the row kernels cannot run this model's batch-1 decode steps, or None when they can."""
    if mesh is not None and mesh.size > 1:
        return f"they run on a single device (a mesh of {mesh.size} splits the weights)"
    if not interpret and (
        target_platform() != "gpu" or "rocm" in getattr(jax.devices()[0].client, "platform_version", "").lower()
    ):
        return f"the Pallas Triton kernels run on NVIDIA GPUs; the backend is {target_platform()!r}"
    if cfg.n_embd % 16:  # the MLP's width is padded to a multiple of 128 (decode.layouts.padded_mlp)
        return f"d={cfg.n_embd} must be a multiple of 16"
    if cfg.spec.latent_layout:
        blocks, _ = cfg.latent_layout
        try:
            check_latent_shapes(cfg.q_lora_rank, cfg.kv_lora_rank // blocks, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim)
        except ValueError as err:
            return str(err)
    return None


def rope_of(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """cos and sin [d_h^R / 2] of the one token's position [1, 1] (latent family; None for the others)."""
    if not cfg.spec.latent_layout:
        return None
    cos, sin = rope_angles(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
    return cos.reshape(-1), sin.reshape(-1)


def block_step(
    block: Block,
    weights: dict,
    x: jax.Array,
    cache: dict[str, jax.Array],
    positions: jax.Array,
    mask: jax.Array,
    index: jax.Array,
    plans: dict,
    rope: tuple[jax.Array, jax.Array] | None,
    interpret: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One block (a serving shell, decode.layouts) and its layer's serving weights (held: weights["attn"],
    weights["mlp"]) on the token's residual row x [d] (float32): the new x and the cache with the token's entry."""
    attn, held = block.attn, weights["attn"]
    if isinstance(attn, LatentAttention):
        heads, cache = _latent_heads(block, held, x, cache, mask, index, rope, interpret)
    else:
        h = block.attn_norm(x[None, None])
        heads, cache = attn.write_and_attend(h, positions, cache, mask, index, plans, True)
        heads = attn.gated(h, heads)[0, 0]
    o_proj, mlp = held["o_proj"], weights["mlp"]
    x = matvec_add(heads.reshape(-1), o_proj.reshape(o_proj.shape[0], -1), x, interpret=interpret)
    h = swiglu_norm_matvec(x, mlp["gate_up"], block.mlp_norm.scale[...], eps=block.mlp_norm.eps, interpret=interpret)
    return matvec_add(h, mlp["down_proj"], x, interpret=interpret), cache


def _latent_heads(
    block: Block,
    held: dict,
    x: jax.Array,
    cache: dict[str, jax.Array],
    mask: jax.Array,
    index: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    interpret: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The latent attention of the token: its heads' output [h, d_h] (gated when the model is) and the cache with
    its entry. x_proj's row holds c_q | the latent blocks | the RoPE key; the kernels read their parts in place."""
    attn: LatentAttention = block.attn
    cos, sin = rope
    projected = norm_matvec(x, held["x_proj"], block.attn_norm.scale[...], eps=block.attn_norm.eps, interpret=interpret)
    q_up = held["q_up"]  # [h, d_h + d_h^R, d_c']
    q = norm_matvec(
        projected,
        q_up.reshape(-1, q_up.shape[-1]),
        attn.q_norm.scale[...],
        eps=attn.q_norm.eps,
        extra=attn.q_scale,
        interpret=interpret,
    )
    entry = LatentEntry(
        projected, attn.kv_norm.scale[...], offset=attn.q_rank, eps=attn.kv_norm.eps, latent_scale=attn.kv_scale
    )
    q_latent, q_rope, latent, k_rope = latent_queries(
        q.reshape(q_up.shape[:2]),
        held["kv_up"],
        cos,
        sin,
        branches=attn.branches,
        entry=entry,
        caches=(cache["latent"], cache["k_rope"]),
        slot=index.reshape(1),
        interpret=interpret,
    )
    z = latent_attention(
        q_rope[None, None],
        q_latent[None, None],
        k_rope[:, :, 0],
        latent,
        scale=attn.softmax_scale,
        mask=mask,
        impl=attn.impl,
    )
    heads = latent_output(
        z[0, 0], held["kv_up"], branches=attn.branches, branch_scale=attn.branch_scale, interpret=interpret
    )
    if attn.gate_proj is not None:
        heads = attn.gated(block.attn_norm(x[None, None]), heads[None, None])[0, 0]
    return heads, {"latent": latent, "k_rope": k_rope}


def head_logits(final_norm: RMSNorm, head: jax.Array, x: jax.Array, interpret: bool = False) -> jax.Array:
    """Float32 logits [1, V] of the residual row x [d] against the tied head [V, d], the final norm inside."""
    return norm_matvec(x, head, final_norm.scale[...], eps=final_norm.eps, out_dtype=jnp.float32, interpret=interpret)[
        None
    ]
