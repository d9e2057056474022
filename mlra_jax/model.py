"""The Llama-3 decoder (paper App. D): pre-norm blocks, SwiGLU, tied embeddings.

The layers' parameters are stacked on a leading axis of size n_layer, whether the
forward pass scans over them (`scan_layers=True`: compile time flat in depth) or
unrolls a Python loop: one parameter layout for both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax import fp8, fused_elementwise
from mlra_jax.attention import attention_class
from mlra_jax.attention.core import ATTENTION_INPUTS
from mlra_jax.attention.fused import KERNEL_PRIMITIVES
from mlra_jax.config import ModelConfig
from mlra_jax.kv_cache import DecodeState, slot_mask
from mlra_jax.layers import MLP, Embed, RMSNorm
from mlra_jax.pallas_kernels.remat_names import MLRA_ATTENTION_RESIDUALS
from mlra_jax.sharding import constrain_batch


def _dots_and_attention(prim: Any, *args: Any, **params: Any) -> bool:
    """Keep the projections and the fused attention kernels' results: the backward reruns no attention kernel (the
    fused elementwise kernels are recomputed, as XLA's fusions are)."""
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params) or (
        prim.name in KERNEL_PRIMITIVES and not fused_elementwise.is_elementwise_kernel(params)
    )


def _dots_attention_and(*names: str) -> Callable[..., bool]:
    """dots_attn's policy, also keeping the values named (jax.ad_checkpoint.checkpoint_name) `names`."""
    return jax.checkpoint_policies.save_from_both_policies(
        _dots_and_attention, jax.checkpoint_policies.save_only_these_names(*names)
    )


REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "full": None,  # save nothing, recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projections, recompute attention
    # keep projections and fused attention outputs (our MLRA kernel's by name: its Mosaic GPU call is opaque to
    # policies); recompute elementwise work
    "dots_attn": _dots_attention_and(*MLRA_ATTENTION_RESIDUALS),
    # dots_attn and the attention kernel's keys and values (the per-head up-projections with RoPE): the backward
    # reruns no product; it recomputes the norms, the queries' RoPE and the SwiGLU product
    "dots_attn_kv": _dots_attention_and(*MLRA_ATTENTION_RESIDUALS, *ATTENTION_INPUTS[1:]),
    # and the queries too: the backward recomputes the norms and the SwiGLU product only
    "dots_attn_qkv": _dots_attention_and(*MLRA_ATTENTION_RESIDUALS, *ATTENTION_INPUTS),
}


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm((cfg.n_embd,), ("embed",), cfg, rngs=rngs)
        self.attn = attention_class(cfg.variant)(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm((cfg.n_embd,), ("embed",), cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.mlp(self.mlp_norm(x))

    def fused(
        self, carry: tuple[jax.Array, jax.Array | None], positions: jax.Array, mask: jax.Array | None, dtype: Any
    ) -> tuple[jax.Array, jax.Array]:
        """The block with each residual add fused into the norm after it (fused_elementwise "norms"): carry is the
        stream and the branch still to be added to it (the previous layer's MLP output; None or zeros before the
        first layer); returns the stream after the attention's add and this layer's MLP output. The normed rows
        come out in the compute dtype `dtype`, which every product casts them to."""
        x, pending = carry
        x, h = fused_elementwise.add_rms_norm(x, pending, self.attn_norm.scale[...], self.attn_norm.eps, dtype)
        x, h = fused_elementwise.add_rms_norm(
            x, self.attn(h, positions, mask), self.mlp_norm.scale[...], self.mlp_norm.eps, dtype
        )
        return x, self.mlp(h)

    def cached(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: dict[str, jax.Array],
        mask: jax.Array,
        index: jax.Array,
        plans: dict[str, Any],
        absorbed: bool,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The block on new tokens x [B, T, d]: their cache entries written at `index`, attention over the cache."""
        h = self.attn_norm(x)
        out, cache = self.attn.attend_and_project(h, positions, cache, mask, index, plans, absorbed)
        x = x + out
        return x + self.mlp(self.mlp_norm(x)), cache


def stacked_blocks(cfg: ModelConfig, key: jax.Array) -> Block:
    """n_layer independently initialized blocks whose parameters share a leading layer axis."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))[0]
    states = jax.vmap(lambda k: nnx.state(Block(cfg, rngs=nnx.Rngs(params=k))))(jax.random.split(key, cfg.n_layer))
    return nnx.merge(graphdef, states)


def default_positions(tokens: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = Embed(cfg, rngs=rngs)
        self.blocks = stacked_blocks(cfg, rngs.params())
        self.final_norm = RMSNorm((cfg.n_embd,), ("embed",), cfg, rngs=rngs)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, mask: jax.Array | None = None
    ) -> jax.Array:
        """Float32 logits [B, T, vocab] for tokens [B, T] (causal when mask is None)."""
        return self.embed.attend(self.hidden(tokens, positions, mask))

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, mask: jax.Array | None = None) -> jax.Array:
        """The final-normed hidden states [B, T, d] that the tied head turns into logits."""
        if positions is None:
            positions = default_positions(tokens)
        x = constrain_batch(self.embed(tokens))
        if "norms" in fused_elementwise.kernels(self.config.fused_elementwise):
            return self._fused_hidden(x, positions, mask)
        x, _ = self.run_layers(x, lambda block, h, _: (block(h, positions, mask), None))
        return self.final_norm(x)

    def _fused_hidden(self, x: jax.Array, positions: jax.Array, mask: jax.Array | None) -> jax.Array:
        """hidden's layers with the residual adds fused into the norms (Block.fused): scanned layers carry a zero
        branch into the first, unrolled ones none; the last layer's MLP output is added by the final norm."""
        pending = jnp.zeros(x.shape, self.config.dtype) if self.config.scan_layers else None
        dtype = self.config.dtype
        (x, pending), _ = self.run_layers(
            (x, pending), lambda block, carry, _: (block.fused(carry, positions, mask, dtype), None)
        )
        final = self.final_norm
        return fused_elementwise.add_rms_norm(x, pending, final.scale[...], final.eps)[1]

    def forward_cached(
        self, tokens: jax.Array, state: DecodeState, absorbed: bool = True
    ) -> tuple[jax.Array, DecodeState]:
        """Logits of new tokens [B, T] written into the cache at state.index (prefill or decode step).

        absorbed: the latent family attends with absorbed weights (decoding); False up-projects
        per-head keys and values, cheaper for long prefills."""
        positions, mask = slot_mask(state, tokens.shape[1])
        plans = dict(state.plans)
        x = self.embed(tokens)
        x, kv = self.run_layers(
            x,
            lambda block, h, layer_kv: block.cached(h, positions, layer_kv, mask, state.index, plans, absorbed),
            state.kv,
        )
        logits = self.embed.attend(self.final_norm(x))
        return logits, dataclasses.replace(state, kv=kv, index=state.index + tokens.shape[1])

    def run_layers(
        self, x: Any, apply: Callable[[Block, Any, Any], tuple[Any, Any]], xs: Any = None
    ) -> tuple[Any, Any]:
        """Thread x (an array, or a tuple of them) through the layers, `(x, y) = apply(block, x, xs[layer])` at
        each, scanned or unrolled; returns x and the ys stacked over layers."""
        graphdef, state = nnx.split(self.blocks)
        histories = fp8.stacked_histories()  # FP8 amax histories of the blocks' sites (delayed scaling)
        histories = None if histories is None else histories["blocks"]

        def layer(h: jax.Array, inputs: Any) -> tuple[jax.Array, Any]:
            layer_state, layer_xs, layer_histories = inputs
            block = nnx.merge(graphdef, layer_state)
            with fp8.block_histories(block, layer_histories):
                h, ys = apply(block, h, layer_xs)
            return jax.tree.map(constrain_batch, h), ys

        if self.config.remat in REMAT_POLICIES:  # "auto" is resolved by the trainer (training.remat_choice)
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.config.remat])
        if self.config.scan_layers:
            return jax.lax.scan(layer, x, (state, xs, histories))
        ys = []
        for inputs in unstacked((state, xs, histories), self.config.n_layer):
            x, y = layer(x, inputs)
            ys.append(y)
        return x, (None if xs is None else jax.tree.map(lambda *a: jnp.stack(a), *ys))


def unstacked(tree: Any, n: int) -> list[Any]:
    """The n trees of `tree`'s leaves split along their leading axis of size n. Split, not indexed: the gradient of
    jnp.split is one concatenate, that of n indexings n zero-padded copies summed, which XLA fuses into every
    consumer of the stacked gradient (the gradient norm and the AdamW update ran at a third of their bandwidth on
    an H100 with the 8-layer proxies)."""
    leaves, treedef = jax.tree.flatten(tree)
    pieces = [jnp.split(leaf, n, axis=0) for leaf in leaves]
    return [treedef.unflatten([jnp.squeeze(split[i], axis=0) for split in pieces]) for i in range(n)]


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves: shapes and counts without allocating weights."""
    return nnx.eval_shape(lambda: init_model(cfg))


def fp8_histories(cfg: ModelConfig) -> dict[str, Any]:
    """Fresh FP8 amax histories of the sites that take FP8 in training, {"blocks": nested like the blocks'
    parameters}: each projection's [n_layer, 3, fp8.HISTORY] at its parameter's path, and each attention core's
    that cuDNN's FP8 attention can train ([n_layer, 10, fp8.HISTORY] at the attention module's path, then
    fp8_attention.SITE); empty unless cfg keeps them (delayed scaling)."""
    if not cfg.keeps_fp8_histories:
        return {}
    block = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0)))
    x = jax.ShapeDtypeStruct((1, 2, cfg.n_embd), jnp.float32)
    rows = fp8.history_rows(block, x, jax.ShapeDtypeStruct((1, 2), jnp.int32))
    return {"blocks": fp8.fresh_histories(rows, cfg.n_layer)}


def count_params(model: nnx.Module) -> int:
    """Parameters of a (possibly abstract) model; the tied head counts once."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
