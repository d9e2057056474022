"""The tied head in FP8 (mlra_jax.fp8_head, model.fp8_head "gradients" and "all") on the CPU: the chunked loss and its
gradients against an emulation of the same quantization in float32 and against float32 within FP8's rounding, the
cast kernel (interpret mode) against XLA's quantization, and a train step that takes each path only when asked."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_VOCAB
from mlra_jax.experiments import get_experiment

from mlra_jax import fp8, fp8_casts, fp8_head
from mlra_jax.layers import einsum
from mlra_jax.loss import chunked_next_token_loss, next_token_loss
from mlra_jax.model import init_model
from mlra_jax.training.step import loss_fn

B, T, D, V = 2, 96, 40, 300  # D and V off the GEMMs' multiple of 16: padded
F32 = jnp.float32


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (B, T, D)),
        0.3 * jax.random.normal(keys[1], (V, D)),
        jax.random.randint(keys[2], (B, T), 0, V),
    )


def _fp8_loss(hidden, embedding, targets, mode="all", chunk=32, cast_kernel=False):
    loss = lambda h, e: chunked_next_token_loss(h, e, targets, jnp.bfloat16, chunk, mode, cast_kernel)
    return jax.value_and_grad(loss, argnums=(0, 1))(hidden, embedding)


@jax.default_matmul_precision("highest")
def _emulated(hidden, embedding, targets, mode):
    """The FP8 head's arithmetic with its operands dequantized into float32: loss, d_hidden, d_embedding."""
    dequantized = lambda a, scale, dtype: fp8.quantize(a, scale, dtype).astype(F32) * scale
    h, e = hidden.astype(jnp.bfloat16), embedding.astype(jnp.bfloat16)
    hq = dequantized(h, fp8.scale_of(h, fp8.E4M3), fp8.E4M3)
    eq = dequantized(e, fp8.scale_of(e, fp8.E4M3), fp8.E4M3)
    logits = einsum("btd,vd->btv", hq, eq) if mode == "all" else einsum("btd,vd->btv", h.astype(F32), e.astype(F32))
    g = jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(targets, V)
    gq = dequantized(g, jnp.float32(fp8_head.GRADIENT_SCALE), fp8.E5M2) / targets.size
    return next_token_loss(logits, targets), einsum("btv,vd->btd", gq, eq), einsum("btv,btd->vd", gq, hq)


def _relative(got, want) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@pytest.mark.parametrize("mode", ["gradients", "all"])
def test_loss_and_gradients_are_those_of_the_quantized_operands(mode):
    hidden, embedding, targets = _inputs()
    loss, (d_hidden, d_embedding) = _fp8_loss(hidden, embedding, targets, mode)
    want_loss, want_hidden, want_embedding = _emulated(hidden, embedding, targets, mode)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert d_hidden.shape == hidden.shape and d_embedding.shape == embedding.shape
    assert _relative(d_hidden, want_hidden) < 1e-4 and _relative(d_embedding, want_embedding) < 1e-4


@pytest.mark.parametrize("mode", ["gradients", "all"])
def test_within_fp8_rounding_of_float32_and_chunks_agree(mode):
    hidden, embedding, targets = _inputs(1)
    loss, grads = _fp8_loss(hidden, embedding, targets, mode)
    plain = lambda h, e: next_token_loss(einsum("btd,vd->btv", h, e), targets)  # float32: full precision
    want_loss, want_grads = jax.value_and_grad(plain, argnums=(0, 1))(hidden, embedding)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-2)
    for got, want in zip(grads, want_grads):
        assert 1e-3 < _relative(got, want) < 0.08  # FP8's rounding: neither exact nor off
    whole_loss, whole_grads = _fp8_loss(hidden, embedding, targets, mode, chunk=0)  # the scales: whole tensors'
    np.testing.assert_allclose(float(whole_loss), float(loss), rtol=1e-6)
    for got, want in zip(whole_grads, grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-8)


def test_the_cast_kernel_quantizes_the_hidden_states_as_xla_does(monkeypatch):
    monkeypatch.setattr(fp8_casts, "INTERPRET", True)
    hidden, embedding, targets = _inputs(2)
    hidden = hidden[:, :64]  # the kernel's rows: the chunks' positions, a multiple of 16
    loss, grads = _fp8_loss(hidden, embedding, targets[:, :64], cast_kernel=True)
    want_loss, want_grads = _fp8_loss(hidden, embedding, targets[:, :64], cast_kernel=False)  # mode "all"
    assert float(loss) == float(want_loss)
    for got, want in zip(grads, want_grads):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _tiny(mode: str):
    model = dataclasses.replace(
        get_experiment("gqa_tiny").model,
        compute_dtype="bfloat16",
        matmul_dtype="float8",
        vocab_size=SMALL_VOCAB,
        fp8_head=mode,
    )
    graphdef, state = nnx.split(init_model(model, seed=0))
    return graphdef, nnx.to_pure_dict(state)


@pytest.mark.parametrize("mode", ["off", "gradients", "all"])
def test_a_train_step_runs_the_head_in_fp8_only_as_asked(mode, monkeypatch):
    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    graphdef, params = _tiny(mode)
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, SMALL_VOCAB)
    step = jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, tokens, training=True, loss_chunk=16)))
    hlo = step.lower(params).as_text()
    # a chunk of 2 x 16 positions: the logits' gradient in e5m2 (straight and transposed), the logits from e4m3
    assert (f"tensor<32x{SMALL_VOCAB}xf8E5M2>" in hlo) == (mode != "off")
    assert (f"tensor<{SMALL_VOCAB}x32xf8E5M2>" in hlo) == (mode != "off")
    fp8_logits = re.compile(rf"dot_general.*f8E4M3FN>\) -> tensor<32x{SMALL_VOCAB}xf32>")
    assert bool(fp8_logits.search(hlo)) == (mode == "all")
    # the embedding's gradient from the e5m2 logits' gradient, summed over the tokens without fast accumulation
    exact = re.compile(rf"dot_general.*precision = \[HIGHEST, HIGHEST\] : \(tensor<{SMALL_VOCAB}x32xf8E5M2>")
    assert bool(exact.search(hlo)) == (mode != "off")
    loss, grads = step(params)
    want_loss = loss_fn(graphdef, params, tokens)  # evaluation: the compute dtype everywhere
    assert abs(float(loss) - float(want_loss)) < 0.02 * float(want_loss)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_describe_says_where_the_head_multiplies():
    class Hopper:
        platform, device_kind, compute_capability = "gpu", "H100", "9.0"

    assert fp8_head.describe("compute", "all") == "tied head: the compute dtype"
    assert fp8_head.describe("float8", "off", Hopper()) == "tied head: the compute dtype (model.fp8_head=off)"
    assert fp8_head.describe("float8", "gradients", Hopper()).startswith("tied head: its two gradients' GEMMs in FP8")
    assert fp8_head.describe("float8", "all", Hopper()).startswith("tied head: the logits' and its two gradients'")
    assert "has no FP8 GEMMs" in fp8_head.describe("float8", "all", jax.devices("cpu")[0])


def test_dry_run_says_how_the_head_runs(capsys):
    from mlra_jax.train import main as train_main

    float8 = ("--experiment=gqa_tiny", "--model.compute_dtype=bfloat16", "--model.matmul_dtype=float8", "--dry_run")
    assert train_main([*float8, "--model.fp8_head=gradients"]) == 0
    assert "tied head: the compute dtype (cpu has no FP8 GEMMs)" in capsys.readouterr().out
    assert train_main(list(float8)) == 0
    assert "tied head: the compute dtype (model.fp8_head=off)" in capsys.readouterr().out


@pytest.mark.parametrize("mesh_config", [(2, 4, 1), (1, 4, 2)], ids=["data2_fsdp4", "fsdp4_tensor2"])
def test_a_mesh_quantizes_the_head_as_one_device(mesh_config, monkeypatch):
    """On 8 CPU devices, with the batch over data and FSDP, and with the embedding's vocabulary split over TP: the
    head's scales are the whole tensors' amaxes, so the loss is one device's up to float32 summation order and the
    (bf16) gradients up to their rounding, well inside FP8's."""
    from mlra_jax.config import MeshConfig
    from mlra_jax.params import logical_axes
    from mlra_jax.sharding import batch_sharding, make_mesh, tree_shardings

    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    graphdef, params = _tiny("all")
    tokens = jax.random.randint(jax.random.key(5), (8, 33), 0, SMALL_VOCAB)
    step = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, t, training=True, loss_chunk=16)))
    loss, grads = step(params, tokens)
    data, fsdp, tensor = mesh_config
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:8])
    with jax.set_mesh(mesh):
        host = jax.tree.map(np.asarray, params)
        sharded = jax.device_put(host, tree_shardings(host, logical_axes(nnx.merge(graphdef, params)), mesh))
        mesh_loss, mesh_grads = step(sharded, jax.device_put(np.asarray(tokens), batch_sharding(mesh)))
    np.testing.assert_allclose(float(mesh_loss), float(loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(mesh_grads), jax.tree.leaves(grads)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.array_equal(got, want) or _relative(got, want) < 1e-2
