"""The serving path on a (data, tensor) mesh of CPU devices at the paper's decoding deployments: every variant's decode
step equals the unsharded one, and each layer of a TP step runs two all-reduces of the hidden state (after the
attention and after the MLP) and no other collective: no all-gather of queries or cache, no reduce-scatter."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.config import MeshConfig
from mlra_jax.decode.generator import Generator, left_pad
from mlra_jax.model import init_model
from mlra_jax.params import logical_axes
from mlra_jax.sharding import make_mesh, tree_shardings

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
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    model = nnx.merge(nnx.split(model)[0], jax.device_put(params, tree_shardings(params, logical_axes(model), mesh)))
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
    layers = 2
    if (variant, tensor) == ("mlra2", 4):
        assert kinds == {"all-reduce": 2 * layers + 1, "reduce-scatter": layers}, kinds
    else:
        # per layer: the attention's and the MLP's all-reduce; once: the vocabulary-sharded embedding's
        assert kinds == {"all-reduce": 2 * layers + 1}, kinds


def test_gated_mlra_keeps_the_row_parallel_output_projection():
    want, got, kinds = served("mlra4", 1, 4, gated=True)
    np.testing.assert_allclose(got, want, atol=3e-5)
    assert kinds.get("reduce-scatter") == 2 and "all-gather" not in kinds, kinds


def test_mlra_output_projection_row_parallel_when_asked(monkeypatch):
    """decode.layouts.PROJECT_IN_REGION = False (benchmarks' --tp_output=row_parallel): the heads reduce-scattered
    into the row-parallel o_proj, with the same logits."""
    from mlra_jax.decode import layouts

    monkeypatch.setattr(layouts, "PROJECT_IN_REGION", False)
    want, got, kinds = served("mlra4", 1, 4)
    np.testing.assert_allclose(got, want, atol=3e-5)
    assert kinds == {"all-reduce": 5, "reduce-scatter": 2}, kinds
