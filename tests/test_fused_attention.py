"""Fused attention against the XLA path: splash (the TPU kernel) in Pallas interpret mode on CPU, cuDNN
on a GPU (run there with JAX_PLATFORMS=cuda), the automatic choice and its errors, for every variant."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import loss_and_grads, on_gpu
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.attention import fused
from mlra_jax.attention.core import attention
from mlra_jax.config import MeshConfig
from mlra_jax.sharding import make_mesh
from mlra_jax.variants import VARIANTS


def qkv(hq, hkv, dk, dv, length=256, batch=2, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(keys[0], (batch, length, hq, dk), dtype),
        jax.random.normal(keys[1], (batch, length, hkv, dk), dtype),
        jax.random.normal(keys[2], (batch, length, hkv, dv), dtype),
        jax.random.normal(keys[3], (batch, length, hq, dv), dtype),
    )


def value_and_grads(impl, q, k, v, weights):
    scale = q.shape[-1] ** -0.5
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, scale=scale, impl=impl).astype(jnp.float32) * weights)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


# MHA, GQA, MQA, the latent family's 192/128-like unequal widths (here 48/32), and a 128-position sequence
@pytest.mark.parametrize(
    "hq,hkv,dk,dv,length",
    [(4, 4, 32, 32, 256), (4, 2, 64, 64, 256), (4, 1, 32, 32, 256), (6, 6, 48, 32, 256), (2, 2, 32, 32, 128)],
)
def test_splash_in_interpret_mode_matches_xla(hq, hkv, dk, dv, length):
    q, k, v, weights = qkv(hq, hkv, dk, dv, length)
    loss, grads = value_and_grads("splash", q, k, v, weights)
    want_loss, want_grads = value_and_grads("xla", q, k, v, weights)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) < 1e-5


def test_auto_on_cpu_is_xla_and_forced_kernels_explain_themselves():
    q, k, v, _ = qkv(4, 2, 32, 32, length=100)
    with fused.kernels_chosen() as chosen:
        np.testing.assert_array_equal(
            np.asarray(attention(q, k, v, scale=0.2, impl="auto")),
            np.asarray(attention(q, k, v, scale=0.2, impl="xla")),
        )
    assert chosen == {"xla": 1}
    with pytest.raises(fused.KernelUnavailable, match="cuDNN needs an NVIDIA GPU"):
        attention(q, k, v, scale=0.2, impl="cudnn")
    with pytest.raises(fused.KernelUnavailable, match="multiple of 128, not 100"):
        attention(q, k, v, scale=0.2, impl="splash")
    mask = jnp.ones((2, 100, 100), bool)
    with pytest.raises(fused.KernelUnavailable, match="plain causal mask only"):
        attention(q, k, v, scale=0.2, impl="splash", mask=mask)


def test_auto_falls_back_to_xla_with_one_logged_reason(monkeypatch, caplog):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # auto tries splash first on a TPU
    fused.log_once.cache_clear()
    q, k, v, _ = qkv(4, 2, 32, 32, length=100)
    with caplog.at_level("INFO", logger="mlra_jax.attention.fused"):
        for _ in range(3):
            attention(q, k, v, scale=0.2, impl="auto")
    reasons = [r.message for r in caplog.records if "falling back to XLA" in r.message]
    assert len(reasons) == 1 and "multiple of 128, not 100" in reasons[0]


def tiny(variant, **changes):
    """One layer, heads wide enough for the kernels, output projections live so gradients reach attention."""
    return tiny_model(
        variant,
        **{"n_layer": 1, "n_head": 4, "vocab_size": 256, "max_seq_len": 256, "output_init": "normal", **changes},
    )


def model_loss_and_grads(cfg, impl, tokens, mesh=None):
    return loss_and_grads(dataclasses.replace(cfg, attention_impl=impl), tokens, mesh)


def assert_model_matches(cfg, impl, tokens, loss_rtol, grad_rtol, mesh=None):
    loss, grads = model_loss_and_grads(cfg, impl, tokens, mesh)
    want_loss, want_grads = model_loss_and_grads(cfg, "xla", tokens, mesh)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=loss_rtol)
    flat, want_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)
    for (path, got), want in zip(flat, want_flat):
        if np.linalg.norm(np.asarray(want, np.float64)) > 1e-8:
            assert relative_error(got, want) < grad_rtol, jax.tree_util.keystr(path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_through_splash_in_interpret_mode(variant):
    tokens = jax.random.randint(jax.random.key(1), (2, 129), 0, 256)
    assert_model_matches(tiny(variant), "splash", tokens, loss_rtol=1e-5, grad_rtol=1e-4)


@pytest.mark.parametrize(
    "variant,mesh_config",
    [
        ("mlra4", MeshConfig(data=-1, tensor=4)),
        ("gla2", MeshConfig(data=-1, tensor=2)),
        ("gqa", MeshConfig(data=-1, tensor=2)),
        ("mla", MeshConfig(data=1, fsdp=-1)),
    ],
)
def test_splash_inside_tensor_data_and_fsdp_meshes(variant, mesh_config):
    """The latent family's shard_map region (tensor manual, data automatic), GSPMD heads over tensor, and
    FSDP (parameters split along any dimension: the kernel still sees whole heads of its batch shard)."""
    mesh = make_mesh(mesh_config, jax.devices()[:8])
    tokens = jax.random.randint(jax.random.key(2), (8, 129), 0, 256)
    assert_model_matches(tiny(variant, n_head=8), "splash", tokens, loss_rtol=1e-5, grad_rtol=1e-4, mesh=mesh)


@on_gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_cudnn_equals_xla_for_every_variant_on_gpu(variant):
    """bfloat16: loss within 2e-3 relative, every gradient within 5% (relative norm); cuDNN is chosen by auto.
    float32: auto falls back to XLA (cuDNN takes 16-bit inputs), so the two agree to the bit."""
    tokens = jax.random.randint(jax.random.key(3), (4, 257), 0, 256)
    cfg = tiny(variant, compute_dtype="bfloat16")
    with fused.kernels_chosen() as chosen:
        assert_model_matches(cfg, "auto", tokens, loss_rtol=2e-3, grad_rtol=5e-2)
    assert set(chosen) == {"cudnn"}, chosen
    with fused.kernels_chosen() as chosen:
        loss, _ = model_loss_and_grads(tiny(variant), "auto", tokens)
        want, _ = model_loss_and_grads(tiny(variant), "xla", tokens)
    assert float(loss) == float(want) and set(chosen) == {"xla"}


@on_gpu
@pytest.mark.parametrize("hq,hkv,dk,dv", [(8, 8, 128, 128), (8, 2, 128, 128), (8, 8, 192, 128), (8, 1, 256, 256)])
def test_cudnn_kernel_at_the_paper_widths(hq, hkv, dk, dv):
    q, k, v, weights = qkv(hq, hkv, dk, dv, length=2048, dtype=jnp.bfloat16)
    loss, grads = value_and_grads("cudnn", q, k, v, weights.astype(jnp.float32))
    want_loss, want_grads = value_and_grads("xla", q, k, v, weights.astype(jnp.float32))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-2, atol=2.0)
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) < 2e-2
