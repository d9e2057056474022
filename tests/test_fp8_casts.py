"""The FP8 cast kernel (pallas_kernels.fp8_cast_gpu) in Pallas interpret mode on the CPU: both layouts and the amax
equal their jnp reference, and FP8 training steps through it (mlra_jax.fp8_casts) equal those through XLA's
quantization, on one device and with the batch over four."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import on_gpu
from mlra_jax.pallas_kernels.fp8_cast_gpu import Tiling, quantize_both, quantize_both_reference

from mlra_jax import fp8, fp8_casts
from mlra_jax.config import ConfigError
from mlra_jax.model import fp8_histories, init_model
from mlra_jax.training.step import loss_fn


def _bits(a: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("shape, tiling", [((100, 70), Tiling(16, 32)), ((64, 128), Tiling(32, 64, 2))])
def test_both_layouts_and_the_amax_equal_the_reference(dtype, shape, tiling):
    """Rows and columns off the multiple of 16 come out padded with zeros; values past the format's largest
    saturate; the transposed layout is the straight one's transpose; the amax is of the unquantized x."""
    x = (jax.random.normal(jax.random.key(1), shape, jnp.float32) * 3).astype(jnp.bfloat16)
    inverse_scale = jnp.float32(float(jnp.finfo(dtype).max) / 6.0)  # |x| above 6 saturates
    got = quantize_both(x, inverse_scale, dtype, tiling=tiling, interpret=True)
    want = quantize_both_reference(x, inverse_scale, dtype)
    padded = tuple(size + (-size % 16) for size in shape)
    assert got[0].shape == padded and got[1].shape == padded[::-1] and got[0].dtype == dtype
    np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
    np.testing.assert_array_equal(_bits(got[1]), _bits(got[0]).T)
    assert float(got[2]) == float(want[2]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    largest = float(jnp.finfo(dtype).max)
    assert float(jnp.max(jnp.abs(got[0].astype(jnp.float32)))) == largest  # saturated, not inf or nan
    assert not np.asarray(got[0][shape[0] :].astype(jnp.float32)).any()  # padding: zeros
    assert not np.asarray(got[0][:, shape[1] :].astype(jnp.float32)).any()


def test_the_kernel_names_bad_shapes_and_tilings(monkeypatch):
    with pytest.raises(ValueError, match="2-D operand"):
        quantize_both(jnp.zeros((2, 3, 4)), jnp.float32(1), jnp.float8_e4m3fn, interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        Tiling(48, 128)
    big = jax.ShapeDtypeStruct((2**16, 2**15), jnp.bfloat16)  # 2**31 elements: past the kernel's int32 offsets
    with pytest.raises(ValueError, match="indexes in int32"):
        jax.eval_shape(lambda x: quantize_both(x, jnp.float32(1), jnp.float8_e4m3fn, interpret=True), big)
    monkeypatch.setattr(fp8_casts, "INTERPRET", True)
    on_xla = lambda x: fp8_casts.both_layouts(x, jnp.float32(1), jnp.float8_e4m3fn, 16, kernel=True)  # noqa: E731
    assert _kernel_calls(on_xla, big) == 0  # XLA quantizes it


def test_the_setting_picks_the_kernel_where_it_runs(monkeypatch, caplog):
    monkeypatch.setattr(fp8_casts, "INTERPRET", False)
    fp8_casts._log_once.cache_clear()
    assert not fp8_casts.kernel_runs("auto") and not fp8_casts.kernel_runs("xla")
    with caplog.at_level(logging.INFO, logger="mlra_jax.fp8_casts"):
        assert not fp8_casts.kernel_runs("kernel")  # a CPU: said once, XLA quantizes
    assert "XLA quantizes the FP8 operands" in caplog.text
    monkeypatch.setattr(fp8_casts, "INTERPRET", True)
    assert fp8_casts.kernel_runs("auto") and fp8_casts.kernel_runs("kernel") and not fp8_casts.kernel_runs("xla")
    with pytest.raises(ValueError, match="fp8_casts='fast'"):
        fp8_casts.kernel_runs("fast")
    with pytest.raises(ConfigError, match="fp8_casts"):
        from mlra_jax.experiments.tiny import tiny_model

        dataclasses.replace(tiny_model("gqa"), fp8_casts="fast")


def _fp8_loss(variant: str, casts: str, n_layer: int = 1):
    """An FP8 model's training loss (params, histories, tokens), its parameters and fresh amax histories."""
    from mlra_jax.experiments.tiny import tiny_model

    config = tiny_model(variant, n_layer=n_layer, n_head=4, vocab_size=128)
    config = dataclasses.replace(config, compute_dtype="bfloat16", matmul_dtype="float8", fp8_casts=casts)
    model = init_model(config, seed=0)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    loss = lambda p, h, t: loss_fn(graphdef, p, t, training=True, histories=h)  # noqa: E731
    return loss, params, fp8_histories(config)


def _kernel_calls(fn, *args) -> int:
    """The kernel's calls in fn's program (in interpret mode: its pallas_calls in the jaxpr)."""
    return str(jax.make_jaxpr(fn)(*args)).count("jaxpr=fp8_quantize_both")


def _runs_the_kernel(step, *args) -> bool:
    return _kernel_calls(step, *args) > 0


def _assert_close_steps(got, want) -> None:
    """Loss, gradients and histories of two steps that differ at most where XLA quantized a value it had not yet
    rounded to bf16 (XLA's excess precision; the kernel reads the rounded operand): a few elements of an FP8
    operand one FP8 step apart."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(b) + 1e-6, (np.abs(a - b).max(), np.abs(b).max())


@pytest.mark.parametrize("variant", ["gqa", "mlra4"])
def test_a_train_step_through_the_kernel_is_xlas(variant, monkeypatch):
    """Loss, gradients and the updated amax histories (delayed scaling) of two steps, the second scaled by the
    first one's amaxes, through the kernel and through XLA's quantization; the kernel's step calls it."""
    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    monkeypatch.setattr(fp8_casts, "INTERPRET", True)
    tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 128)
    results = {}
    for casts in ("xla", "kernel"):
        loss, params, histories = _fp8_loss(variant, casts)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        forward, both = _kernel_calls(loss, params, histories, tokens), _kernel_calls(step, params, histories, tokens)
        assert both == 2 * forward and (forward > 0) == (casts == "kernel")  # each x and its output's gradient
        first = step(params, histories, tokens)
        results[casts] = first, step(params, first[1][1], tokens)
    _assert_close_steps(results["kernel"], results["xla"])
    histories = results["kernel"][1][1][1]
    assert all(float(leaf[:, 0, 0].min()) > 0 for leaf in jax.tree.leaves(histories))  # each x amax recorded


@pytest.mark.slow
def test_with_the_batch_over_four_devices_each_quantizes_its_rows(monkeypatch):
    """The batch over 4 devices (data 2 x FSDP 2): the kernel runs per device on its rows (its amaxes the maximum over
    the devices), and the step equals the one-device step; under tensor parallelism XLA quantizes."""
    from mlra_jax.config import MeshConfig
    from mlra_jax.sharding import batch_sharding, make_mesh

    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    monkeypatch.setattr(fp8_casts, "INTERPRET", True)
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, 128)
    loss, params, histories = _fp8_loss("gqa", "kernel")
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    want = step(params, histories, tokens)
    for mesh_config, on_kernel in ((MeshConfig(data=2, fsdp=2, tensor=1), True), (MeshConfig(data=2, tensor=2), False)):
        mesh = make_mesh(mesh_config, jax.devices()[:4])
        with jax.set_mesh(mesh):
            placed = jax.device_put(np.asarray(tokens), batch_sharding(mesh))
            assert _runs_the_kernel(step, params, histories, placed) == on_kernel
            got = step(params, histories, placed)
        if on_kernel:  # each device quantizes its rows as the one device did
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)


@on_gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_on_the_gpu_the_kernel_equals_its_reference(dtype):
    """Compiled by Triton: both layouts bit for bit and the amax, at an FFN operand's width (off the multiple of 16),
    for every tiling the benchmark measured."""
    x = (jax.random.normal(jax.random.key(2), (2048, 9880), jnp.float32) * 3).astype(jnp.bfloat16)
    inverse_scale = jnp.float32(float(jnp.finfo(dtype).max) / 8.0)
    want = quantize_both_reference(x, inverse_scale, dtype)
    for tiling in (Tiling(), Tiling(32, 128, 4), Tiling(128, 128, 8)):
        got = jax.jit(lambda a, s: quantize_both(a, s, dtype, tiling=tiling))(x, inverse_scale)
        np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
        np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))
        assert float(got[2]) == float(want[2])
