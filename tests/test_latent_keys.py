"""The latent family's per-head keys built in one product ([block || RoPE key] times [[W_UK, 0], [0, I]]): the step
forms no concatenation of per-head keys, the RoPE key comes through exactly, and `auto` takes the product for
blocks up to 128 wide. Its loss and gradients equal the concatenated keys' in test_absorbed_training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mlra_jax.experiments import get_experiment
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.attention.latent import LatentAttention
from mlra_jax.config import ConfigError
from mlra_jax.model import init_model
from mlra_jax.training.step import loss_fn
from mlra_jax.variants import LATENT_VARIANTS


def small(variant, keys, **changes):
    return tiny_model(
        variant,
        **{"n_layer": 1, "n_head": 8, "vocab_size": 128, "output_init": "normal", "latent_keys": keys, **changes},
    )


def per_head_concatenations(cfg):
    """Concatenations in the training step's jaxpr (forward and backward) whose output has the per-head queries'
    and keys' shape [B, S, blocks, block_heads, d_h + d_h^R]."""
    model = init_model(cfg)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jnp.zeros((2, 17), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_fn(graphdef, p, tokens)))(params)
    blocks, branches = cfg.latent_layout
    keys = (2, 16, blocks, cfg.n_head * branches // blocks, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "concatenate" and tuple(eqn.outvars[0].aval.shape) == keys:
                yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jaxpr.jaxpr))


def test_product_keys_form_no_concatenation_of_per_head_keys():
    """Concatenated keys: the queries' [q_nope || q_rope] and the keys' [k_nope || k_rope]; product keys: the
    queries' only."""
    assert len(per_head_concatenations(small("mlra4", "concat", scan_layers=False))) == 2
    assert len(per_head_concatenations(small("mlra4", "product", scan_layers=False))) == 1


def test_auto_takes_product_keys_for_blocks_up_to_128_wide():
    for name in LATENT_VARIANTS:
        for cfg in (small(name, "auto"), get_experiment(f"{name}_2p9b").model):
            width = cfg.kv_lora_rank // cfg.latent_layout[0]
            layer = nnx.eval_shape(lambda: LatentAttention(cfg, rngs=nnx.Rngs(0)))  # no weights materialized
            assert layer.product_keys == (width <= 128), (name, width)
    paper = {name: get_experiment(f"{name}_2p9b").model for name in LATENT_VARIANTS}
    widths = {name: cfg.kv_lora_rank // cfg.latent_layout[0] for name, cfg in paper.items()}
    assert widths == {"mla": 512, "gla2": 256, "gla4": 128, "mlra2": 128, "mlra4": 128}
    with pytest.raises(ConfigError, match="latent_keys='product' applies to the latent family"):
        tiny_model("gqa", latent_keys="product")


def test_product_keys_hold_the_rope_key_exactly():
    """The identity columns copy the RoPE key: the product's last d_h^R channels equal it bit for bit (bf16)."""
    attn = LatentAttention(small("mlra4", "product", compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    b, s, n, r = 2, 16, attn.blocks, attn.block_rank
    latent = jax.random.normal(jax.random.key(2), (b, s, n, r), jnp.bfloat16)
    k_rope = jax.random.normal(jax.random.key(3), (b, s, 1, attn.rope_dim), jnp.bfloat16)
    keys = attn.per_head_keys(latent, k_rope, attn.up_weights()[0])
    assert keys.shape == (b, s, n, attn.block_heads, attn.nope_dim + attn.rope_dim)
    np.testing.assert_array_equal(
        np.asarray(keys[..., attn.nope_dim :], np.float32),
        np.asarray(jnp.broadcast_to(k_rope[:, :, :, None, :], keys.shape[:-1] + (attn.rope_dim,)), np.float32),
    )
