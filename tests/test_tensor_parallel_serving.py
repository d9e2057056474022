"""The serving path on a (data, tensor) mesh of CPU devices at the paper's decoding deployments: every variant's decode
step equals the unsharded one, and each layer of a TP step runs two all-reduces of the hidden state (after the
attention and after the MLP) and no other collective: no all-gather of queries or cache, no reduce-scatter."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sharded_over
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.config import MeshConfig
from mlra_jax.decode.generator import Generator, left_pad
from mlra_jax.model import init_model
from mlra_jax.sharding import make_mesh

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def served(variant: str, data: int, tensor: int, **changes):
    """(the unsharded step's logits, the sharded step's logits, the sharded step's collectives by kind)."""
    cfg = tiny_model(variant, **{"n_layer": 2, "n_head": 8, "vocab_size": 64, "output_init": "normal", **changes})
    model = init_model(cfg, seed=0)
    unsharded = Generator(model, max_len=16)
    _, state = unsharded.prefill(PROMPTS)
    want = np.asarray(unsharded.step(jnp.arange(4)[:, None], state)[0])[:, 0]
    mesh = make_mesh(MeshConfig(data=data, tensor=tensor), jax.devices()[: data * tensor])
    model = sharded_over(model, mesh)
    serving = Generator(model, max_len=16, mesh=mesh).serving
    tokens, starts = left_pad(PROMPTS)
    _, session = serving.prefill(tokens, starts, 1, 16)
    got = np.asarray(serving.step(jnp.arange(4)[:, None], session))
    with jax.set_mesh(mesh):
        step = serving.compiled(True, (4, 1))
        hlo = step.lower(serving.weights, jnp.arange(4)[:, None], session.caches).compile().as_text()
    kinds: dict[str, int] = {}
    for line in hlo.splitlines():
        match = COLLECTIVE.search(line)
        if match:
            kinds[match.group(1)] = kinds.get(match.group(1), 0) + 1
    return want, got, kinds


@pytest.mark.parametrize(
    "variant, data, tensor, changes",
    [
        ("mlra4", 1, 4, {}),  # the paper's MLRA-4 TP=4: the output projected in the blocks' region
        ("mlra2", 1, 2, {}),
        ("mlra2", 1, 4, {}),  # each device serves half the heads: reduce-scatter into the row-parallel o_proj
        ("gla2", 2, 2, {}),
        ("gqa", 1, 4, {"n_head": 24, "group_size": 4}),  # 6 KV heads at TP=4: stored by the heads that read them
    ],
)
def test_tensor_parallel_decode_steps_equal_the_unsharded_step(variant, data, tensor, changes):
    want, got, kinds = served(variant, data, tensor, **changes)
    np.testing.assert_allclose(got, want, atol=3e-5)
    assert "all-gather" not in kinds, kinds
    # per layer: the attention's and the MLP's all-reduce; once: the vocabulary-sharded embedding's
    assert kinds == {"all-reduce": 2 * 2 + 1}, kinds


@pytest.mark.parametrize(
    "variant, data, tensor, changes",
    [
        ("mlra4", 1, 4, {"gated": True}),  # each device gates its heads
        ("mlra4", 1, 2, {}),  # two branches on each device: their queries computed once
        ("mlra4", 1, 8, {}),  # each block stored on two devices, each serving half its heads
        ("mla", 1, 4, {}),  # one block on every device, the heads split
        ("mla", 4, 1, {}),  # data parallel only: the held layouts of one device
    ],
)
def test_more_deployments_equal_the_unsharded_step(variant, data, tensor, changes):
    want, got, kinds = served(variant, data, tensor, **changes)
    np.testing.assert_allclose(got, want, atol=3e-5)
    assert kinds == ({"all-reduce": 2 * 2 + 1} if tensor > 1 else {}), kinds


@pytest.mark.parametrize(
    "tp_output, collectives",
    [("in_region", {"all-reduce": 5}), ("row_parallel", {"all-reduce": 5, "reduce-scatter": 2})],
)
def test_the_modules_as_trained_serve_when_asked(monkeypatch, tp_output, collectives):
    """decode.region_block.REGION_BLOCKS = False (benchmarks' --tp_output=in_region or row_parallel): the modules
    run under GSPMD with MLRA's output projected in the attention's region, or row-parallel after a reduce-scatter
    of the heads (decode.layouts.PROJECT_IN_REGION = False), with the same logits."""
    from mlra_jax.decode import layouts, region_block

    monkeypatch.setattr(region_block, "REGION_BLOCKS", False)
    monkeypatch.setattr(layouts, "PROJECT_IN_REGION", tp_output == "in_region")
    want, got, kinds = served("mlra4", 1, 4)
    np.testing.assert_allclose(got, want, atol=3e-5)
    assert kinds == collectives, kinds


def test_region_blocks_reduce_in_bfloat16_within_rounding_of_float32(monkeypatch):
    """MLRA-4 at TP=4 in bfloat16: the region's decode steps all-reduce the hidden state's partials in bfloat16
    (tensor_parallel.DECODE_REDUCE_DTYPE), and the logits stay within bfloat16 rounding of the float32 reduction's."""
    import mlra_jax.tensor_parallel as tp_module

    cfg = tiny_model("mlra4", n_layer=2, n_head=8, vocab_size=64, output_init="normal", compute_dtype="bfloat16")
    model = init_model(cfg, seed=0)
    mesh = make_mesh(MeshConfig(data=1, tensor=4), jax.devices()[:4])
    model = sharded_over(model, mesh)
    tokens, starts = left_pad(PROMPTS)
    logits, reduced = {}, {}
    for dtype in ("compute", "float32"):
        monkeypatch.setattr(tp_module, "DECODE_REDUCE_DTYPE", dtype)
        serving = Generator(model, max_len=16, mesh=mesh).serving
        _, session = serving.prefill(tokens, starts, 1, 16)
        with jax.set_mesh(mesh):
            lowered = serving.compiled(True, (4, 1)).lower(serving.weights, jnp.arange(4)[:, None], session.caches)
        logits[dtype] = np.asarray(serving.step(jnp.arange(4)[:, None], session))
        stablehlo = lowered.as_text()  # before XLA's CPU compiler widens bfloat16 reductions
        reduced[dtype] = re.findall(r"stablehlo\.all_reduce\".*?\}\) : \(tensor<([^>]*)>", stablehlo, re.DOTALL)
    # the regions' two per layer (the embedding's all-reduce comes from GSPMD, after lowering)
    assert [r.rsplit("x", 1)[1] for r in reduced["compute"]] == ["bf16"] * 4, reduced
    assert [r.rsplit("x", 1)[1] for r in reduced["float32"]] == ["f32"] * 4, reduced
    scale = float(np.abs(logits["float32"]).max())
    np.testing.assert_allclose(logits["compute"], logits["float32"], atol=0.02 * scale)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_decode_steps_on_folded_absorbed_weights(monkeypatch, compute_dtype):
    """MLRA-4 at TP=4 (one latent block of rank <= d_h per device, decode.region_block.folds): decode steps on W_UK
    folded into q_up and W_UV into o_proj give the separate weights' logits (float32: to its rounding; bfloat16:
    within its rounding) with two products fewer per layer, and the floor's weights leave out the trained copies
    that only prefill chunks read."""
    from mlra_jax.benchmarks import roofline
    from mlra_jax.decode import region_block

    cfg = tiny_model("mlra4", n_layer=2, n_head=8, vocab_size=64, output_init="normal", compute_dtype=compute_dtype)
    model = init_model(cfg, seed=0)
    mesh = make_mesh(MeshConfig(data=1, tensor=4), jax.devices()[:4])
    assert region_block.folds(cfg, region_block.plan_of(cfg, 4))
    model = sharded_over(model, mesh)
    tokens, starts = left_pad(PROMPTS)
    logits, dots, held, read = {}, {}, {}, {}
    for fold in (True, False):
        monkeypatch.setattr(region_block, "FOLD_ABSORBED", fold)
        serving = Generator(model, max_len=16, mesh=mesh).serving
        _, session = serving.prefill(tokens, starts, 1, 16)  # on the weights as trained
        with jax.set_mesh(mesh):
            lowered = serving.compiled(True, (4, 1)).lower(serving.weights, jnp.arange(4)[:, None], session.caches)
        dots[fold] = lowered.as_text().count("stablehlo.dot_general")
        logits[fold] = np.asarray(serving.step(jnp.arange(4)[:, None], session))
        layers = serving.weights["layers"]
        held[fold], read[fold] = roofline.shard_bytes(layers), roofline.shard_bytes(region_block.decode_read(layers))
        trained = [layer["region"]["attn"].get(region_block.PREFILL_ONLY, {}) for layer in layers]
        assert bool(trained[0]) == fold
        assert read[fold] == held[fold] - roofline.shard_bytes(trained)
    assert dots[False] - dots[True] == 2 * cfg.n_layer, dots
    assert read[True] < read[False] < held[True]
    scale = float(np.abs(logits[False]).max())
    atol = 2e-5 if compute_dtype == "float32" else 0.02 * scale
    np.testing.assert_allclose(logits[True], logits[False], atol=atol)
