"""FP8 training matmuls (mlra_jax.fp8) on the CPU: the products and their gradients against an exact emulation of
the same quantization and against float32 within FP8's rounding, which products take the path, a train step
through it, and the fallback where the backend has no FP8 GEMMs."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_VOCAB
from mlra_jax.experiments import get_experiment

from mlra_jax import fp8
from mlra_jax.config import ConfigError
from mlra_jax.layers import einsum
from mlra_jax.model import fp8_histories, init_model
from mlra_jax.training.step import loss_fn

SPEC = "btd,dhk->bthk"


def _operands(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (2, 48, 96), jnp.float32)
    w = jax.random.normal(keys[1], (96, 4, 40), jnp.float32) * 0.05
    cotangent = jax.random.normal(keys[2], (2, 48, 4, 40), jnp.float32)
    return x, w, cotangent


def _emulated(x, w, cotangent):
    """The same per-tensor quantization, dequantized and multiplied in float32: what the FP8 GEMMs compute."""
    dequantized = lambda a, dtype: (
        fp8.quantize(a, fp8.scale_of(a, dtype), dtype).astype(jnp.float32) * fp8.scale_of(a, dtype)
    )
    x2, w2, g2 = x.reshape(96, 96), w.reshape(96, 160), cotangent.reshape(96, 160)
    xq, wq, gq = dequantized(x2, fp8.E4M3), dequantized(w2, fp8.E4M3), dequantized(g2, fp8.E5M2)
    return xq @ wq, gq @ wq.T, xq.T @ gq


@jax.default_matmul_precision("highest")
def test_products_and_gradients_are_the_fp8_quantized_ones():
    x, w, cotangent = _operands()
    out, pullback = jax.vjp(lambda a, b: fp8.fp8_project(a, b, SPEC, jnp.float32), x, w)
    grad_x, grad_w = pullback(cotangent)
    want_out, want_grad_x, want_grad_w = _emulated(x, w, cotangent)
    np.testing.assert_allclose(out.reshape(96, 160), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_x.reshape(96, 96), want_grad_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_w.reshape(96, 160), want_grad_w, rtol=1e-5, atol=1e-5)
    assert out.dtype == grad_x.dtype == grad_w.dtype == jnp.float32


@jax.default_matmul_precision("highest")
@pytest.mark.parametrize("delayed", [False, True])
def test_dimensions_off_the_gemms_multiple_are_padded_with_zeros(delayed):
    """M, K and N that are not multiples of 16 (the FP8 GEMMs' granularity; the 2.9B MLRA-4's FFN width is 9880):
    the operands are padded with zeros before quantizing, and the product and both gradients come out at the
    operands' own shapes with the unpadded quantization's values."""
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (94, 90), jnp.float32)
    w = jax.random.normal(keys[1], (90, 150), jnp.float32) * 0.05
    cotangent = jax.random.normal(keys[2], (94, 150), jnp.float32)
    if delayed:  # a history holding these very amaxes: the dynamic scales
        amaxes = jnp.stack([jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(cotangent).max()])
        history = amaxes[:, None]
        product = lambda a, b: fp8.fp8_matmul_delayed(a, b, history, jnp.float32)  # noqa: E731
    else:
        product = lambda a, b: fp8.fp8_matmul(a, b, jnp.float32)  # noqa: E731
    out, pullback = jax.vjp(product, x, w)
    grad_x, grad_w = pullback(cotangent)[:2]
    dequantized = lambda a, dtype: (  # noqa: E731
        fp8.quantize(a, fp8.scale_of(a, dtype), dtype).astype(jnp.float32) * fp8.scale_of(a, dtype)
    )
    xq, wq, gq = dequantized(x, fp8.E4M3), dequantized(w, fp8.E4M3), dequantized(cotangent, fp8.E5M2)
    assert out.shape == (94, 150) and grad_x.shape == (94, 90) and grad_w.shape == (90, 150)
    np.testing.assert_allclose(out, xq @ wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_x, gq @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_w, xq.T @ gq, rtol=1e-5, atol=1e-5)
    operands = jax.make_jaxpr(lambda a, b: jax.vjp(product, a, b)[1](cotangent))(x, w)
    dots = [e for e in operands.jaxpr.eqns if e.primitive.name == "dot_general"]
    shapes = {tuple(v.aval.shape) for e in dots for v in e.invars}
    assert dots and all(size % fp8.DIM_MULTIPLE == 0 for shape in shapes for size in shape), shapes


@jax.default_matmul_precision("highest")
def test_products_and_gradients_are_within_fp8_rounding_of_float32():
    """e4m3 keeps 3 mantissa bits, e5m2 2: a few percent of the norm, not more."""
    x, w, cotangent = _operands(1)
    out, pullback = jax.vjp(lambda a, b: fp8.fp8_project(a, b, SPEC, jnp.float32), x, w)
    want, want_pullback = jax.vjp(lambda a, b: einsum(SPEC, a, b), x, w)
    relative = lambda got, ref: float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert relative(out, want) < 0.05
    for got, ref in zip(pullback(cotangent), want_pullback(cotangent)):
        assert 0 < relative(got, ref) < 0.08


def test_saturation_and_zero_tensors():
    big = jnp.array([[1e6, -1e6, 3.0]], jnp.float32)
    quantized = fp8.quantize(big, jnp.float32(1.0), fp8.E4M3).astype(jnp.float32)
    np.testing.assert_array_equal(quantized, [[448.0, -448.0, 3.0]])  # saturates, never inf or nan
    assert float(fp8.scale_of(jnp.zeros((4, 4)), fp8.E4M3)) == 1.0
    out = fp8.fp8_matmul(jnp.zeros((8, 16)), jnp.ones((16, 8)), jnp.float32)
    assert bool(jnp.all(out == 0))


def _history(x_amax=3.0, w_amax=0.1, g_amax=2.5, length=4):
    """A non-zero history of `length` steps whose largest amaxes (the scales') are not at index 0."""
    decay = jnp.linspace(0.5, 1.0, length)
    return jnp.stack([decay * x_amax, decay * w_amax, decay * g_amax]).astype(jnp.float32)


def _emulated_with(x, w, cotangent, scales):
    """`_emulated` with the given scales of x, w and the gradient: what the delayed-scaling GEMMs compute."""
    dequantized = lambda a, scale, dtype: fp8.quantize(a, scale, dtype).astype(jnp.float32) * scale
    x2, w2, g2 = x.reshape(96, 96), w.reshape(96, 160), cotangent.reshape(96, 160)
    xq, wq, gq = (dequantized(a, s, d) for a, s, d in zip((x2, w2, g2), scales, (fp8.E4M3, fp8.E4M3, fp8.E5M2)))
    return xq @ wq, gq @ wq.T, xq.T @ gq


def _delayed_vjp(x, w, cotangent, history):
    out, pullback = jax.vjp(lambda a, b, h: fp8.fp8_project(a, b, SPEC, jnp.float32, h), x, w, history)
    return (out, *pullback(cotangent))


def _rolled(history, amaxes):
    return jnp.concatenate([jnp.asarray(amaxes, jnp.float32)[:, None], history[:, :-1]], axis=1)


@jax.default_matmul_precision("highest")
def test_delayed_products_and_gradients_use_the_historys_scales_and_the_weights_own():
    x, w, cotangent = _operands(2)
    history = _history()
    out, grad_x, grad_w, _ = _delayed_vjp(x, w, cotangent, history)
    scales = [float(jnp.max(row)) / fp8.MAX[d] for row, d in zip(history, (fp8.E4M3, fp8.E4M3, fp8.E5M2))]
    scales[1] = float(fp8.scale_of(w, fp8.E4M3))  # the weight by its own amax
    want_out, want_grad_x, want_grad_w = _emulated_with(x, w, cotangent, scales)
    np.testing.assert_allclose(out.reshape(96, 160), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_x.reshape(96, 96), want_grad_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_w.reshape(96, 160), want_grad_w, rtol=1e-5, atol=1e-5)
    assert out.dtype == grad_x.dtype == grad_w.dtype == jnp.float32


def test_the_history_cotangent_is_the_rolled_history_with_the_current_amaxes():
    x, w, cotangent = _operands(3)
    history = _history()
    *_, updated = _delayed_vjp(x, w, cotangent, history)
    assert updated.shape == history.shape and updated.dtype == jnp.float32
    amaxes = [jnp.max(jnp.abs(a)) for a in (x, w, cotangent)]
    np.testing.assert_array_equal(updated[:, 0], amaxes)
    np.testing.assert_array_equal(updated, _rolled(history, amaxes))


@jax.default_matmul_precision("highest")
def test_a_fresh_history_scales_x_and_the_gradient_by_one_and_larger_amaxes_saturate():
    x, w, cotangent = _operands(4)
    x, cotangent = x * 1000.0, cotangent * 1e5  # beyond e4m3's 448 and e5m2's 57344: saturated at scale 1
    fresh = fp8.new_history()
    assert fresh.shape == (3, fp8.HISTORY) and not bool(fresh.any())
    out, grad_x, grad_w, updated = _delayed_vjp(x, w, cotangent, fresh)
    want_out, want_grad_x, want_grad_w = _emulated_with(x, w, cotangent, (1.0, fp8.scale_of(w, fp8.E4M3), 1.0))
    for got, want in ((out, want_out), (grad_x, want_grad_x), (grad_w, want_grad_w)):
        assert bool(jnp.isfinite(got).all())
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(updated, _rolled(fresh, [jnp.max(jnp.abs(a)) for a in (x, w, cotangent)]))
    small = _history(1.0, 1.0, 1.0)  # the history's amax 1, the tensor's 1e6: saturates at the format's max
    quantized = fp8.quantize(jnp.array([1e6, -1e6]), fp8.scale_from_history(small[0], fp8.E4M3), fp8.E4M3)
    np.testing.assert_array_equal(quantized.astype(jnp.float32), [448.0, -448.0])


@jax.default_matmul_precision("highest")
def test_a_small_or_growing_weight_is_neither_flushed_nor_saturated():
    """A zero-initialized projection's first update (1e-5) under a history that recorded its zeros, and a weight
    10x above its history's amax (warmup grows every weight): each is quantized by its own amax."""
    x, w, cotangent = _operands(7)
    for weight, history in ((w * 1e-4, fp8.new_history()), (w, _history(w_amax=0.1 * float(jnp.max(jnp.abs(w)))))):
        out, grad_x, _, _ = _delayed_vjp(x, weight, cotangent, history)
        scales = (float(jnp.max(history[0])) / fp8.MAX[fp8.E4M3] or 1.0, fp8.scale_of(weight, fp8.E4M3))
        scales = (*scales, float(jnp.max(history[2])) / fp8.MAX[fp8.E5M2] or 1.0)
        want_out, want_grad_x, _ = _emulated_with(x, weight, cotangent, scales)
        assert float(jnp.abs(out).max()) > 0
        for got, want in ((out, want_out), (grad_x, want_grad_x)):
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))
        dequantized = fp8.quantize(weight, scales[1], fp8.E4M3).astype(jnp.float32) * scales[1]
        assert float(jnp.linalg.norm(dequantized - weight) / jnp.linalg.norm(weight)) < 0.05  # FP8's rounding only


def test_merged_micro_batch_histories_hold_the_batchs_amax():
    history = _history()
    (x1, w, g1), (x2, _, g2) = _operands(5), _operands(6)
    first, second = _delayed_vjp(x1, w, g1, history)[3], _delayed_vjp(x2, w, g2, history)[3]
    amaxes = [jnp.maximum(jnp.max(jnp.abs(a)), jnp.max(jnp.abs(b))) for a, b in ((x1, x2), (w, w), (g1, g2))]
    np.testing.assert_array_equal(fp8.merge_histories(first, second), _rolled(history, amaxes))


def test_histories_under_a_layer_scan_and_remat():
    """A scan over stacked weights and histories gives each layer its own updated history, that of the same
    layers unrolled; under remat (keeping the products) the layers' outputs and the histories are the same."""
    layers, width = 3, 32
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (2, 8, width), jnp.float32)
    ws = jax.random.normal(keys[1], (layers, width, width), jnp.float32) * 0.2
    histories = jnp.stack([_history(3.0 * (i + 1), 0.5, 1e-3) for i in range(layers)])
    weights = jax.random.normal(keys[2], x.shape)
    layer = lambda h, wh: (jnp.tanh(fp8.fp8_project(h, wh[0], "btd,df->btf", jnp.float32, wh[1])), h)

    def scanned(x, ws, histories, policy=None):
        out, inputs = jax.lax.scan(
            layer if policy is None else jax.checkpoint(layer, policy=policy), x, (ws, histories)
        )
        return jnp.sum(out * weights), inputs

    def unrolled(x, ws, histories):
        for i in range(layers):
            x = layer(x, (ws[i], histories[i]))[0]
        return jnp.sum(x * weights)

    grad = lambda f, *args: jax.grad(f, argnums=(0, 1, 2), has_aux=f is scanned)(x, ws, histories, *args)
    grads, inputs = grad(scanned)
    updated = grads[2]
    assert updated.shape == histories.shape and updated.dtype == jnp.float32
    for i in range(layers):
        np.testing.assert_array_equal(updated[i, :2, 0], [jnp.max(jnp.abs(inputs[i])), jnp.max(jnp.abs(ws[i]))])
        np.testing.assert_array_equal(updated[i, :, 1:], histories[i, :, :-1])
        assert float(updated[i, 2, 0]) > 0
    np.testing.assert_allclose(updated, grad(unrolled)[2], rtol=1e-6)
    (grad_x, grad_w, remat_updated), remat_inputs = grad(
        scanned, jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    )
    np.testing.assert_array_equal(remat_inputs, inputs)
    np.testing.assert_array_equal(remat_updated, updated)
    np.testing.assert_allclose(grad_x, grads[0], rtol=1e-4, atol=1e-9)  # float32 fusion order, not FP8
    np.testing.assert_allclose(grad_w, grads[1], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(
    "spec,taken",
    [
        ("btd,df->btf", True),
        ("bthk,hkd->btd", True),  # the output projection contracts heads and head width
        ("btd,dnr->btnr", True),
        ("btd,gfd->btgf", False),  # serving's out-major layout
        ("bthk,hkd->bd", False),
        ("btd,vd->btv", False),  # the tied head's product is not a projection
    ],
)
def test_which_products_take_the_fp8_path(spec, taken):
    shapes = {"b": 2, "t": 3, "d": 8, "f": 16, "h": 2, "k": 4, "n": 2, "r": 4, "g": 2, "v": 10}
    x_axes, rest = spec.split(",")
    w_axes = rest.split("->")[0]
    x = jnp.ones([shapes[a] for a in x_axes])
    w = jnp.ones([shapes[a] for a in w_axes])
    assert (fp8.fp8_project(x, w, spec, jnp.float32) is not None) == taken


@functools.cache
def _tiny(matmul_dtype: str):
    """mlra4_tiny's model with 512 tokens (the products in question are the layers'; GPT-2's 50,304-row output
    layer was most of the work). Made once per process: the tests only read it."""
    experiment = get_experiment("mlra4_tiny")
    model = dataclasses.replace(
        experiment.model, compute_dtype="bfloat16", matmul_dtype=matmul_dtype, vocab_size=SMALL_VOCAB
    )
    graphdef, state = nnx.split(init_model(model, seed=0))
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, model.vocab_size)
    return graphdef, nnx.to_pure_dict(state), tokens


def test_a_train_step_runs_its_projections_in_fp8(monkeypatch):
    """With FP8 GEMMs available (here: pretended), every projection's forward and backward products take FP8
    operands, and loss and gradients stay close to the bfloat16 step's."""
    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    graphdef, params, tokens = _tiny("float8")
    step = jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, tokens, training=True)))
    hlo = step.lower(params).as_text()
    assert hlo.count("f8E4M3FN") > 0 and hlo.count("f8E5M2") > 0
    evaluation = jax.jit(lambda p: loss_fn(graphdef, p, tokens)).lower(params).as_text()
    assert "f8E4M3FN" not in evaluation  # evaluation runs in the compute dtype
    loss, grads = step(params)
    bf16_graphdef, _, _ = _tiny("compute")
    want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(bf16_graphdef, p, tokens)))(params)
    assert abs(float(loss) - float(want_loss)) < 0.01 * float(want_loss)
    flat, want_flat = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
    assert all(bool(jnp.isfinite(g).all()) for g in flat)
    norm = lambda tree: float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in tree)))
    difference = norm([g - h for g, h in zip(flat, want_flat)])
    assert 0 < difference < 0.1 * norm(want_flat)


def test_without_fp8_gemms_the_step_is_the_compute_dtypes_and_says_so(caplog):
    fp8._report_fallback.cache_clear()
    graphdef, params, tokens = _tiny("float8")
    with caplog.at_level(logging.WARNING, logger="mlra_jax.fp8"):
        loss = loss_fn(graphdef, params, tokens, training=True)
    assert "has no FP8 GEMMs" in caplog.text
    plain_graphdef, _, _ = _tiny("compute")
    assert float(loss) == float(loss_fn(plain_graphdef, params, tokens))


def test_float8_needs_a_bfloat16_compute_dtype():
    model = get_experiment("mlra4_tiny").model
    with pytest.raises(ConfigError, match="matmul_dtype='float8' trains with compute_dtype='bfloat16'"):
        dataclasses.replace(model, matmul_dtype="float8")
    with pytest.raises(ConfigError, match="matmul_dtype"):
        dataclasses.replace(model, compute_dtype="bfloat16", matmul_dtype="int8")


def test_supported_reads_the_compute_capability():
    class Device:
        platform, device_kind = "gpu", "fake"

        def __init__(self, capability):
            self.compute_capability = capability

    assert fp8.supported(Device("9.0")) and fp8.supported(Device("8.9"))
    assert not fp8.supported(Device("8.0")) and not fp8.supported(jax.devices("cpu")[0])
    assert "FP8 GEMMs (e4m3 / e5m2" in fp8.describe("float8", Device("9.0"))
    assert f"per-tensor delayed scaling (amax history of {fp8.HISTORY})" in fp8.describe("float8", Device("9.0"))
    assert "per-tensor dynamic scaling" in fp8.describe("float8", Device("9.0"), scaling="dynamic")
    assert fp8.describe("float8", Device("9.0")).endswith("gradients quantized by the FP8 cast kernel")
    assert fp8.describe("float8", Device("9.0"), casts="xla").endswith("gradients quantized by XLA's fusions")
    assert "has no FP8 GEMMs: the compute dtype" in fp8.describe("float8", jax.devices("cpu")[0])
    assert fp8.describe("compute") == "projections: the compute dtype"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mha", "mqa", "gqa", "mla", "mfa", "tpa", "gla2", "gla4", "gta", "mlra2", "mlra4"])
def test_every_variant_trains_in_fp8_under_tp_and_fsdp(variant, monkeypatch):
    """Each variant's FP8 loss on 8 CPU devices, with TP=2 and FSDP=4 on one mesh, is the unsharded FP8 loss up to
    the per-shard scales of the tensor-parallel region (FP8 rounding), and its gradients are finite."""
    from mlra_jax.experiments.tiny import tiny_model

    from mlra_jax.config import MeshConfig
    from mlra_jax.params import logical_axes
    from mlra_jax.sharding import batch_sharding, make_mesh, tree_shardings

    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    config = tiny_model(variant, n_layer=1, n_head=8, vocab_size=128, output_init="normal")
    config = dataclasses.replace(config, compute_dtype="bfloat16", matmul_dtype="float8")
    model = init_model(config, seed=0)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, 128)
    histories = fp8_histories(config)  # delayed scaling: the updated histories come back as their "gradients"
    value_and_grad = jax.jit(
        jax.value_and_grad(lambda p, h, t: loss_fn(graphdef, p, t, training=True, histories=h), argnums=(0, 1))
    )
    loss, (_, updated) = value_and_grad(params, histories, tokens)
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=2), jax.devices()[:8])
    with jax.set_mesh(mesh):
        host = jax.tree.map(np.asarray, params)  # placed from the host: no resharding computations to compile
        sharded = jax.device_put(host, tree_shardings(host, logical_axes(model), mesh))
        mesh_loss, (grads, mesh_updated) = value_and_grad(
            sharded, histories, jax.device_put(np.asarray(tokens), batch_sharding(mesh))
        )
    np.testing.assert_allclose(float(mesh_loss), float(loss), rtol=1e-2)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    for want, got in zip(jax.tree.leaves(updated), jax.tree.leaves(mesh_updated)):  # global amaxes, newest
        np.testing.assert_array_equal(got[:, 1], want[:, 1])  # the weights': exact
        np.testing.assert_allclose(got[:, ::2, 0], want[:, ::2, 0], rtol=0.1)  # x and gradient: FP8 rounding


@pytest.mark.slow
def test_gradient_accumulation_in_fp8(monkeypatch):
    """Two micro-batches of an FP8 step give the loss of one whole batch (the scales are per micro-batch)."""
    import optax

    from mlra_jax.training.step import make_train_step

    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    graphdef, params, _ = _tiny("float8")
    tokens = jax.random.randint(jax.random.key(4), (4, 33), 0, SMALL_VOCAB)
    whole = make_train_step(graphdef, optax.sgd(0.0), accumulation_steps=1)
    split = make_train_step(graphdef, optax.sgd(0.0), accumulation_steps=2)
    whole_metrics = jax.jit(whole)(params, optax.sgd(0.0).init(params), {}, tokens)[3]
    split_metrics = jax.jit(split)(params, optax.sgd(0.0).init(params), {}, tokens)[3]
    assert bool(split_metrics["finite"])
    np.testing.assert_allclose(float(split_metrics["loss"]), float(whole_metrics["loss"]), rtol=1e-2)
    np.testing.assert_allclose(float(split_metrics["grad_norm"]), float(whole_metrics["grad_norm"]), rtol=5e-2)


def test_a_remat_policy_keeps_fp8_products_in_the_compute_dtype():
    """Under `dots` the kept products are bfloat16, as without FP8: remat="auto"'s estimate holds for FP8 too."""
    from jax._src.ad_checkpoint import saved_residuals

    from mlra_jax.model import REMAT_POLICIES, Block, default_positions

    config = dataclasses.replace(get_experiment("mlra4_tiny").model, compute_dtype="bfloat16", matmul_dtype="float8")
    graphdef, state = nnx.split(Block(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    x = jnp.ones((2, 16, config.n_embd), jnp.float32)
    positions = default_positions(jnp.zeros((2, 16), jnp.int32))
    with fp8.matmuls(True):

        def layer(p, h):  # defined here: jax.checkpoint caches its trace by function
            return nnx.merge(graphdef, p)(h, positions)

        kept = [
            aval
            for aval, source in saved_residuals(jax.checkpoint(layer, policy=REMAT_POLICIES["dots"]), params, x)
            if "fp8" in source
        ]
    assert len(kept) == 7 and {aval.dtype for aval in kept} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("variant", ["gqa", "mlra4"])
def test_the_projections_of_one_input_quantize_it_once(variant, monkeypatch):
    """Under delayed scaling the projections of one x (q, k and v; the MLP's gate and up) scale x by the first one's
    x row, whose amaxes theirs equal: loss, gradients and updated histories are those of each projection scaling x
    by its own row, bit for bit, and the compiled step makes fewer quantized copies of the activations."""
    import re

    from mlra_jax.experiments.tiny import tiny_model

    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    config = tiny_model(variant, n_layer=2, n_head=4, vocab_size=128)
    config = dataclasses.replace(config, compute_dtype="bfloat16", matmul_dtype="float8", scan_layers=False)
    model = init_model(config, seed=0)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 128)

    def step():
        loss = lambda p, h: loss_fn(graphdef, p, tokens, training=True, histories=h)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    monkeypatch.setattr(fp8, "SHARE_INPUT_SCALES", True)
    shared = step()  # traced with shared input scales: its trace and executable serve the first case below
    histories = shared(params, fp8_histories(config))[1][1]  # one step's amaxes: every x row holds x's
    results, copies = {}, {}
    for share in (True, False):
        monkeypatch.setattr(fp8, "SHARE_INPUT_SCALES", share)
        compiled = (shared if share else step()).lower(params, histories).compile()
        pattern = rf"= f8e4m3fn\[{tokens.shape[0]},{tokens.shape[1] - 1},{config.n_embd}\]"  # x [B, T, d] in FP8
        copies[share] = len(re.findall(pattern, compiled.as_text()))
        results[share] = compiled(params, histories)
    for got, want in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False])):
        np.testing.assert_array_equal(got, want)
    assert copies[True] == 2 * config.n_layer < copies[False], copies  # per layer: x and the MLP's input
