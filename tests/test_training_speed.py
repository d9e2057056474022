"""The fast-path settings: remat that keeps the fused attention, bf16 weights before FSDP gathers, the
micro-batch resolved per mesh, the GPU XLA flags, and runs that resume under other runtime settings."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from helpers import micro_experiment
from mlra_jax import xla_flags
from mlra_jax.config import ConfigError, TrainConfig
from mlra_jax.experiments import get_experiment
from mlra_jax.experiments.tiny import tiny_model
from mlra_jax.model import init_model
from mlra_jax.training.step import compute_params, loss_fn
from mlra_jax.training.loop import train
from mlra_jax.training.state import build_setup


def count_primitive(jaxpr, name):
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += count_primitive(inner, name)
    return total


@pytest.mark.parametrize("remat,kernels", [("dots", 4), ("dots_attn", 3), ("none", 3)])
def test_dots_attn_remat_never_reruns_the_attention_kernel(remat, kernels):
    """Splash: one forward kernel and two backward ones; 'dots' reruns the forward inside the backward."""
    cfg = tiny_model("gqa", n_layer=1, vocab_size=256, attention_impl="splash", remat=remat)
    model = init_model(cfg)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jnp.zeros((2, 129), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_fn(graphdef, p, tokens)))(params)
    assert count_primitive(jaxpr.jaxpr, "pallas_call") == kernels


def test_weights_enter_the_step_in_the_compute_dtype_but_norms_and_embedding_stay_float32():
    model = init_model(tiny_model("mlra4", n_layer=1, compute_dtype="bfloat16"))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    cast = compute_params(params, jnp.bfloat16)
    assert cast["blocks"]["attn"]["kv_up"].dtype == jnp.bfloat16
    assert cast["blocks"]["mlp"]["down_proj"].dtype == jnp.bfloat16
    assert cast["blocks"]["attn"]["kv_norm"]["scale"].dtype == jnp.float32
    assert cast["embed"]["embedding"].dtype == jnp.float32


@pytest.mark.parametrize("replicas,micro", [(1, 8), (2, 16), (4, 32), (8, 48), (16, 96), (480, 480)])
def test_micro_batch_is_the_largest_within_the_per_device_cap(replicas, micro):
    train_cfg = TrainConfig(global_batch_size=480, max_micro_batch_per_device=8).for_replicas(replicas)
    assert train_cfg.micro_batch_size == micro and 480 % micro == 0
    assert TrainConfig(micro_batch_size=96, max_micro_batch_per_device=8).for_replicas(4).micro_batch_size == 96
    with pytest.raises(ConfigError, match="does not split over 7"):
        TrainConfig(global_batch_size=480, max_micro_batch_per_device=8).for_replicas(7)


def test_the_paper_runs_take_the_fast_path_without_flags():
    experiment = get_experiment("mlra4_2p9b")
    assert experiment.model.attention_impl == "auto" and experiment.model.remat == "dots_attn"
    assert experiment.model.scan_layers is False and experiment.train.loss_chunk == 512
    setup = build_setup(experiment)  # 8 CPU devices: 480 / 8 = 60 per device, 6 at a time
    assert setup.experiment.train.micro_batch_size == 48 and setup.experiment.train.accumulation_steps == 10


def test_xla_flags_keep_the_users_values(monkeypatch):
    merged = xla_flags.merged_flags("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1", xla_flags.GPU_FLAGS)
    assert merged.startswith("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1")
    assert merged.count("latency_hiding") == 1 and "--xla_gpu_all_gather_combine_threshold_bytes=" in merged
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    monkeypatch.setattr(xla_flags, "cuda_plugin_installed", lambda: True)
    monkeypatch.setenv(xla_flags.DISABLE_VARIABLE, "0")
    assert not xla_flags.apply_gpu_defaults() and xla_flags.os.environ["XLA_FLAGS"] == "--foo=1"
    monkeypatch.delenv(xla_flags.DISABLE_VARIABLE)
    assert xla_flags.apply_gpu_defaults() and "latency_hiding_scheduler=true" in xla_flags.os.environ["XLA_FLAGS"]
    monkeypatch.undo()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not xla_flags.cuda_plugin_installed()  # JAX_PLATFORMS=cpu (the tests): no flags added


def test_a_run_resumes_under_other_runtime_settings_but_not_another_model(tmp_path):
    devices = jax.devices()[:1]
    train(micro_experiment("mlra4_tiny", "--train.total_steps=4", "--train.eval_every=0",
                           "--model.attention_impl=xla"), tmp_path, devices=devices)
    result = train(micro_experiment("mlra4_tiny", "--train.total_steps=8", "--train.eval_every=0",
                                    "--model.remat=dots_attn", "--model.scan_layers=false"), tmp_path, devices=devices,
                   allow_changed=("train.total_steps",))
    assert result.step == 8
    with pytest.raises(ConfigError, match="model.n_embd was 64, now 32"):
        train(micro_experiment("mlra4_tiny", "--model.n_embd=32"), tmp_path, devices=devices)
