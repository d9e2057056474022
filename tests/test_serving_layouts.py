"""The serving layer's weights (decode.layouts) and its XLA block steps (decode.serving_block) on the CPU: the held
weights and the shell's together are the trained parameters, each once; the trained modules are left as they were;
a block step over the held weights, in both layouts, gives the module path's output and cache entries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.decode import layouts, serving_block
from mlra_jax.kv_cache import init_layer_caches, slot_mask
from mlra_jax.model import init_model
from mlra_jax.params import compute_params

LATENT_AND_OTHERS = ["mlra4", "mlra2", "mla", "gqa", "tpa", "mfa", "gta"]


def _model(variant: str, **changes):
    cfg = tiny_model(variant, n_layer=2, vocab_size=64, output_init="normal", **changes)
    return init_model(cfg, seed=3)


def _elements(tree) -> int:
    return sum(int(a.size) for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("variant", LATENT_AND_OTHERS)
@pytest.mark.parametrize("out_major", [False, True])
def test_held_and_module_weights_are_the_trained_parameters_once(variant, out_major):
    model = _model(variant)
    blocks = nnx.to_pure_dict(nnx.state(model.blocks, nnx.Param))
    held, kept = layouts.held_weights(blocks, out_major), layouts.module_weights(blocks)
    assert _elements(held) + _elements(kept) == _elements(blocks)
    assert "mlp" not in kept and "o_proj" not in kept["attn"]
    shell_state = nnx.to_pure_dict(nnx.state(layouts.serving_shell(model.blocks), nnx.Param))
    assert jax.tree.structure(shell_state) == jax.tree.structure(kept)
    if variant.startswith(("mla", "mlra", "gla")):
        assert set(held["attn"]) == {"o_proj", "x_proj", "q_up", "kv_up"}
        assert not set(layouts.LATENT_HELD) & set(kept["attn"])
    else:  # the other variants' attention runs as trained, on its own weights
        assert set(held["attn"]) == {"o_proj"} and set(kept["attn"]) == set(blocks["attn"]) - {"o_proj"}


def test_the_held_layouts_hold_the_same_products():
    model = _model("mlra4")
    attn = nnx.to_pure_dict(nnx.state(model.blocks.attn, nnx.Param))
    attn = jax.tree.map(lambda a: a[0], attn)  # one layer
    x = jax.random.normal(jax.random.key(0), (5, attn["q_down"].shape[0]))
    separate = [
        x @ attn["q_down"],
        jnp.einsum("td,dnr->tnr", x, attn["kv_down"]).reshape(5, -1),
        x @ attn["k_rope_proj"],
    ]
    for out_major in (False, True):
        held = layouts.attention_weights(attn, out_major)
        merged = x @ (held["x_proj"].T if out_major else held["x_proj"])
        np.testing.assert_allclose(merged, jnp.concatenate(separate, axis=-1), rtol=1e-6, atol=1e-6)
        q_up = jnp.moveaxis(held["q_up"], -1, -3) if out_major else held["q_up"]
        np.testing.assert_array_equal(q_up, attn["q_up"])
        o_proj = jnp.moveaxis(held["o_proj"], -3, -1) if out_major else held["o_proj"]
        np.testing.assert_array_equal(o_proj, attn["o_proj"])
    nope = attn["kv_up"].shape[-1] // 2
    kv_up = layouts.attention_weights(attn, False)["kv_up"]  # [2, n, H, R, d_h]
    np.testing.assert_array_equal(jnp.swapaxes(kv_up[0], 1, 2), attn["kv_up"][..., :nope])
    np.testing.assert_array_equal(jnp.swapaxes(kv_up[1], 1, 2), attn["kv_up"][..., nope:])
    mlp = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(nnx.state(model.blocks.mlp, nnx.Param)))
    both = layouts.mlp_weights(mlp, True)
    np.testing.assert_array_equal(both["gate_up"][0].T, mlp["gate_proj"])
    np.testing.assert_array_equal(both["gate_up"][1].T, mlp["up_proj"])
    np.testing.assert_array_equal(both["down_proj"].T, mlp["down_proj"])


def test_the_serving_shell_leaves_the_trained_block_as_it_was():
    model = _model("mlra4")
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    before = model(tokens)
    shell = layouts.serving_shell(model.blocks)
    assert shell.mlp is None and shell.attn.kv_up is None and shell.attn.o_proj is None
    assert model.blocks.attn.kv_up is not None and model.blocks.mlp is not None
    np.testing.assert_array_equal(model(tokens), before)


@pytest.mark.parametrize("variant,gated", [("mlra4", True), ("mla", False), ("mlra2", False), ("gqa", True)])
@pytest.mark.parametrize("out_major", [False, True])
@pytest.mark.parametrize("absorbed", [False, True])
def test_a_serving_block_step_gives_the_module_blocks_output_and_cache(variant, gated, out_major, absorbed):
    model = _model(variant, gated=gated)
    cfg = model.config
    blocks = compute_params(nnx.to_pure_dict(nnx.state(model.blocks, nnx.Param)), cfg.dtype)
    graphdef = nnx.split(model.blocks)[0]
    shell_def = nnx.split(layouts.serving_shell(model.blocks))[0]
    held, kept = layouts.held_weights(blocks, out_major), layouts.module_weights(blocks)
    layer = lambda tree: jax.tree.map(lambda a: a[0], tree)
    caches = init_layer_caches(cfg, 2, 16, jnp.array([0, 1], jnp.int32))
    tokens = 1 if absorbed else 4
    positions, mask = slot_mask(caches, tokens)
    x = jax.random.normal(jax.random.key(1), (2, tokens, cfg.n_embd), jnp.float32)
    args = (positions, caches.layers[0], mask, caches.index, dict(caches.plans), absorbed)
    want, want_cache = nnx.merge(graphdef, layer(blocks)).cached(x, *args)
    got, got_cache = serving_block.block_step(nnx.merge(shell_def, layer(kept)), layer(held), x, *args, out_major)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    for name in want_cache:
        np.testing.assert_allclose(got_cache[name], want_cache[name], rtol=2e-5, atol=2e-5)


def test_serving_compiler_options_on_gpus_take_the_one_shot_all_reduce_only_when_asked(monkeypatch):
    """On GPUs: Triton GEMMs off above TRITON_GEMM_ROWS rows; XLA's one-shot all-reduce kernel only for calls under
    tensor parallelism with TP_ALL_REDUCE "one_shot"; the option is one this XLA knows (a CPU compile takes it)."""
    from mlra_jax.decode import serving

    monkeypatch.setattr(serving, "target_platform", lambda: "gpu")
    one_shot = serving.ONE_SHOT_ALL_REDUCE_OPTION
    assert serving.serving_compiler_options(1) == serving.SERVING_COMPILER_OPTIONS
    assert serving.serving_compiler_options(64)["xla_gpu_enable_triton_gemm"] is False
    assert one_shot not in serving.serving_compiler_options(64, tensor_parallel=True)  # NCCL by default
    monkeypatch.setattr(serving, "TP_ALL_REDUCE", "one_shot")
    assert serving.serving_compiler_options(64, tensor_parallel=True)[one_shot] is True
    assert one_shot not in serving.serving_compiler_options(64, tensor_parallel=False)
    doubled = jax.jit(lambda x: 2 * x, compiler_options={one_shot: True})(jnp.ones(3))
    np.testing.assert_array_equal(doubled, 2 * np.ones(3))
