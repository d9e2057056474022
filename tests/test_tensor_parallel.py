"""Tensor parallelism on 8 CPU devices: every variant equals its unsharded self in training and
decoding, per-device caches match paper Table 1, and MLRA-4's TP=4 decode never gathers its cache."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mlra_jax.experiments.paper_tables import TABLE_VARIANTS, analysis_config
from mlra_jax.experiments.tiny import tiny_model
from test_info import TABLE1

from mlra_jax.config import ConfigError, MeshConfig
from mlra_jax.kv_cache import init_cache, measured_kv_bytes_per_token
from mlra_jax.model import init_model
from mlra_jax.params import logical_axes
from mlra_jax.sharding import batch_sharding, make_mesh, tree_shardings
from mlra_jax.tensor_parallel import per_device_bytes
from mlra_jax.training.step import loss_fn
from mlra_jax.variants import VARIANTS

pytestmark = pytest.mark.slow  # every variant under TP degrees 2, 4, 8: not in the fast subset

TP_DEGREES = (2, 4, 8)


def small(variant, **changes):
    return tiny_model(variant, **{"n_layer": 1, "n_head": 8, "vocab_size": 128, "output_init": "normal", **changes})


def mesh_for(tp, devices=8):
    return make_mesh(MeshConfig(data=-1, tensor=tp), jax.devices()[:devices])


def shard_params(model, params, mesh):
    """Placed from host copies: no resharding computation to compile per parameter shape."""
    params = jax.tree.map(np.asarray, params)
    return jax.device_put(params, tree_shardings(params, logical_axes(model), mesh))


@functools.cache
def initialized(variant, **changes):
    """(model, graphdef, params) of small(variant, **changes) at seed 0, made once per process: the tests only read
    them."""
    model = init_model(small(variant, **changes), seed=0)
    return model, nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))


def largest(x) -> float:
    return float(np.abs(np.asarray(x)).max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_gradients_match_unsharded(variant):
    model, graphdef, params = initialized(variant)
    tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 128)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, t)))
    loss, grads = value_and_grad(params, tokens)
    for tp in TP_DEGREES:
        mesh = mesh_for(tp)
        with jax.set_mesh(mesh):
            tp_loss, tp_grads = value_and_grad(
                shard_params(model, params, mesh), jax.device_put(np.asarray(tokens), batch_sharding(mesh))
            )
        np.testing.assert_allclose(float(tp_loss), float(loss), rtol=1e-6, err_msg=f"TP={tp}")
        for a, b in zip(jax.tree.leaves(tp_grads), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-6 * largest(b) + 1e-9, err_msg=f"TP={tp}")


def decode(model, params, tokens, mesh=None):
    """Prefill 4 tokens, then decode the rest one at a time: the logits of every position, the final cache, and the
    jitted step (step.lower(params, token, state, True): a decode step's program, its trace reused)."""
    graphdef = nnx.split(model)[0]
    step = jax.jit(lambda p, t, s, absorbed: nnx.merge(graphdef, p).forward_cached(t, s, absorbed), static_argnums=3)
    state = init_cache(model.config, tokens.shape[0], 16, mesh=mesh)
    logits, state = step(params, tokens[:, :4], state, False)
    outputs = [logits]
    for i in range(4, tokens.shape[1]):
        logits, state = step(params, tokens[:, i : i + 1], state, True)
        outputs.append(logits)
    return np.concatenate([np.asarray(x) for x in outputs], axis=1), state, step


@functools.cache
def unsharded_decode(variant, seed, **changes):
    """The unsharded model's decode() logits of the tokens of `seed`, made once per process."""
    model, _, params = initialized(variant, **changes)
    tokens = jax.random.randint(jax.random.key(seed), (2, 7), 0, 128)
    return tokens, decode(model, params, tokens)[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_with_sharded_cache_matches_unsharded(variant):
    model, _, params = initialized(variant)
    tokens, expected = unsharded_decode(variant, 1)
    for tp in TP_DEGREES:
        mesh = make_mesh(MeshConfig(data=1, tensor=tp), jax.devices()[:tp])
        with jax.set_mesh(mesh):
            logits, state, _ = decode(model, shard_params(model, params, mesh), tokens, mesh)
        np.testing.assert_allclose(logits, expected, atol=2e-5, err_msg=f"TP={tp}")
        assert all(a.sharding.mesh.shape["tensor"] == tp for a in state.kv.values())


@pytest.mark.parametrize("variant", TABLE_VARIANTS)
def test_measured_per_device_cache_matches_table1(variant):
    cfg = analysis_config(variant)
    measured = tuple(measured_kv_bytes_per_token(cfg, tp) / jnp.dtype(cfg.dtype).itemsize / 128 for tp in (1, 2, 4, 8))
    assert measured == TABLE1[variant][1]


def test_mlra4_tp4_decode_never_gathers_the_latent_cache():
    model, graphdef, params = initialized("mlra4")  # n_layer=1
    cfg = model.config
    mesh = make_mesh(MeshConfig(data=1, tensor=4), jax.devices()[:4])
    max_len = 96  # a length no other tensor has
    with jax.set_mesh(mesh):
        state = init_cache(cfg, 2, max_len, mesh=mesh)
        step = jax.jit(lambda p, t, s: nnx.merge(graphdef, p).forward_cached(t, s))
        hlo = step.lower(shard_params(model, params, mesh), jnp.zeros((2, 1), jnp.int32), state).compile().as_text()
    assert state.kv["latent"].sharding.spec[3] == "tensor"
    gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    assert gathers, "expected the query all-gather of MLRA's branches"
    shapes = [re.search(r"= \w+\[([\d,]*)\]", line).group(1).split(",") for line in gathers]
    assert all(str(max_len) not in dims for dims in shapes), gathers
    assert "reduce-scatter(" in hlo  # the branch outputs meet in one reduce-scatter


def test_tp_degrees_the_latent_family_cannot_use():
    model = init_model(small("mlra4", n_head=3, n_layer=1), seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mesh = mesh_for(8)
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match="its 3 heads do not divide among them"):
        jax.jit(lambda p: nnx.merge(nnx.split(model)[0], p)(jnp.zeros((8, 4), jnp.int32)))(params)
    gla2 = init_model(small("gla2", n_layer=1), seed=0)
    mesh3 = make_mesh(MeshConfig(data=1, tensor=3), jax.devices()[:3])
    with jax.set_mesh(mesh3), pytest.raises(ConfigError, match="TP=3 cannot split 2 latent blocks"):
        gla2(jnp.zeros((1, 4), jnp.int32))


def test_kv_heads_that_do_not_divide_are_replicated(caplog):
    """GQA with 6 KV heads at TP=4: the cache falls back to replication and decoding stays exact."""
    model, _, params = initialized("mha", n_head=6, head_dim=16)
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, 128)
    expected, *_ = decode(model, params, tokens)
    mesh = make_mesh(MeshConfig(data=1, tensor=4), jax.devices()[:4])
    with jax.set_mesh(mesh), caplog.at_level("WARNING"):
        logits, state, _ = decode(model, shard_params(model, params, mesh), tokens, mesh)
    np.testing.assert_allclose(logits, expected, atol=2e-5)
    assert "6 slices cannot be divided over TP=4" in caplog.text
    assert per_device_bytes(state.kv["k"]) == state.kv["k"].nbytes


@pytest.mark.parametrize("data", [1, 2])
def test_gqa_kv_heads_stored_by_the_query_heads_that_read_them(data):
    """GQA with 6 KV heads of 24 query heads at TP=4 (the 2.9B GQA's layout): each device stores the 2 KV heads its
    6 query heads read, prefill and decode equal the unsharded model, and no step gathers the cache."""
    changes = dict(n_head=24, group_size=4, head_dim=8)
    model, _, params = initialized("gqa", **changes)
    tokens, expected = unsharded_decode("gqa", 3, **changes)
    mesh = make_mesh(MeshConfig(data=data, tensor=4), jax.devices()[: 4 * data])
    with jax.set_mesh(mesh):
        sharded = shard_params(model, params, mesh)
        logits, state, step = decode(model, sharded, tokens, mesh)
        hlo = step.lower(sharded, tokens[:, :1], state, True).compile().as_text()
    np.testing.assert_allclose(logits, expected, atol=2e-5)
    plan = dict(state.plans)["k"]
    assert plan.aligned and plan.unit_index.tolist() == [0, 1, 1, 2, 3, 4, 4, 5]
    assert state.kv["k"].shape[3] == 8 and per_device_bytes(state.kv["k"]) == state.kv["k"].nbytes // (4 * data)
    assert not [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]


def products_batched_on_inner_axes(stablehlo: str) -> list[str]:
    """dot_generals batched over axes that are not an operand's leading ones: a GPU's batched GEMM takes them only
    after copying that operand transposed (for a product over the cache: the whole cache, every step)."""
    found = []
    for line in stablehlo.splitlines():
        dims = re.search(r"batching_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", line)
        if dims and any([int(i) for i in d.split(",")] != list(range(len(d.split(",")))) for d in dims.groups()):
            found.append(line.strip())
    return found


@pytest.mark.parametrize("n_head, group_size", [(16, 2), (8, 4)])
def test_gqa_decode_reads_split_and_spread_caches_as_stored(n_head, group_size, monkeypatch):
    """GQA whose KV heads TP splits (8 over 4 devices) or spreads (2 over 4): decode steps score each device's query
    heads against the KV heads it stores as stored and equal the unsharded model; no product is batched over the
    cache's inner KV-head axis, as the grouped product they replace is."""
    import mlra_jax.attention.gqa as gqa_module

    model, _, params = initialized("gqa", n_head=n_head, group_size=group_size, head_dim=8)
    tokens = jax.random.randint(jax.random.key(5), (2, 7), 0, 128)
    expected, *_ = decode(model, params, tokens)
    mesh = make_mesh(MeshConfig(data=1, tensor=4), jax.devices()[:4])
    transposes = {}
    for slots in (0, gqa_module.MAX_SLOTS_READ_AS_STORED):
        monkeypatch.setattr(gqa_module, "MAX_SLOTS_READ_AS_STORED", slots)
        with jax.set_mesh(mesh):
            sharded = shard_params(model, params, mesh)
            logits, state, step = decode(model, sharded, tokens, mesh)
            stablehlo = step.lower(sharded, tokens[:, :1], state, True).as_text()
        np.testing.assert_allclose(logits, expected, atol=2e-5)
        transposes[slots] = products_batched_on_inner_axes(stablehlo)
    plan = dict(state.plans)["k"]
    with jax.set_mesh(mesh):
        assert plan.sharded and not plan.aligned and gqa_module.reads_cache_as_stored(plan, 1)
        assert not gqa_module.reads_cache_as_stored(plan, 7)  # prefill keeps the grouped product
    assert not transposes[gqa_module.MAX_SLOTS_READ_AS_STORED] and transposes[0]


def test_decode_branch_sums_in_bfloat16_against_float32(monkeypatch):
    """MLRA-4 at TP=4 in bfloat16: decode steps reduce the branch sums in bfloat16 (half the bytes), and the logits
    stay within bfloat16 rounding of the float32 reduction's."""
    import mlra_jax.tensor_parallel as tp_module

    model, _, params = initialized("mlra4", compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(4), (2, 7), 0, 128)
    mesh = make_mesh(MeshConfig(data=1, tensor=4), jax.devices()[:4])
    outputs, reductions = {}, {}
    for dtype in ("compute", "float32"):
        monkeypatch.setattr(tp_module, "DECODE_REDUCE_DTYPE", dtype)
        with jax.set_mesh(mesh):
            sharded = shard_params(model, params, mesh)
            outputs[dtype], state, step = decode(model, sharded, tokens, mesh)
            hlo = step.lower(sharded, tokens[:, :1], state, True).as_text()
        reductions[dtype] = re.findall(r"stablehlo\.reduce_scatter\".*?\}\) : \(tensor<([^>]*)>", hlo, re.DOTALL)
    assert reductions["compute"] and all(r.endswith("bf16") for r in reductions["compute"]), reductions
    assert reductions["float32"] and all(r.endswith("f32") for r in reductions["float32"]), reductions
    scale = float(np.abs(outputs["float32"]).max())
    np.testing.assert_allclose(outputs["compute"], outputs["float32"], atol=0.02 * scale)


@pytest.mark.parametrize("variant", ["mla", "mlra4"])
def test_bfloat16_training_under_tp(variant):
    """bf16 compute through the latent shard_map region, backward included (float32 params)."""
    model, graphdef, params = initialized(variant, compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 128)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, t)))
    loss, grads = value_and_grad(params, tokens)
    mesh = mesh_for(4)
    with jax.set_mesh(mesh):
        tp_loss, tp_grads = value_and_grad(
            shard_params(model, params, mesh), jax.device_put(np.asarray(tokens), batch_sharding(mesh))
        )
    np.testing.assert_allclose(float(tp_loss), float(loss), rtol=2e-3)
    for a, b in zip(jax.tree.leaves(tp_grads), jax.tree.leaves(grads)):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0.03 * largest(b) + 1e-6)
