"""The fast-path settings: remat that keeps the fused attention, bf16 weights before FSDP gathers, the
micro-batch resolved per mesh, the GPU XLA flags, and runs that resume under other runtime settings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import GPT2, micro_experiment
from mlra_jax.experiments import get_experiment
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax import xla_flags
from mlra_jax.config import ConfigError, TrainConfig
from mlra_jax.model import init_model
from mlra_jax.params import compute_params
from mlra_jax.training import remat_choice, state
from mlra_jax.training.loop import train
from mlra_jax.training.state import build_setup, state_bytes
from mlra_jax.training.step import loss_fn


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


def grad_jaxpr(cfg, tokens):
    model = init_model(cfg)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.make_jaxpr(jax.grad(lambda p: loss_fn(graphdef, p, tokens)))(params).jaxpr


def test_named_remat_policies_keep_the_attention_inputs_so_the_backward_reruns_fewer_products():
    """MLRA-4's per-head keys and values come from a batched product (the W_UK / W_UV up-projection) that
    dots_attn recomputes in the backward; dots_attn_kv and dots_attn_qkv keep the kernel's keys and values by
    name, so their backward has that product's forward no more, and none has the fewest products."""
    tokens = jnp.zeros((2, 129), jnp.int32)
    dots = {
        remat: count_primitive(
            grad_jaxpr(tiny_model("mlra4", n_layer=1, vocab_size=256, attention_impl="splash", remat=remat), tokens),
            "dot_general",
        )
        for remat in ("none", "dots_attn_qkv", "dots_attn_kv", "dots_attn")
    }
    assert dots["none"] == dots["dots_attn_qkv"] == dots["dots_attn_kv"] < dots["dots_attn"], dots


def test_unrolled_layers_give_back_each_stacked_gradient_as_one_concatenate():
    """The layers' parameters are split off their stack, not indexed: the stacked gradient is one concatenate of
    the layers' gradients, never n_layer zero-padded copies summed (which XLA fused into the gradient norm and the
    AdamW update, both then at a third of their bandwidth on an H100)."""
    cfg = tiny_model("mlra4", n_layer=3, vocab_size=256, scan_layers=False)
    model = init_model(cfg)
    stacked = {tuple(a.shape) for a in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model.blocks, nnx.Param)))}
    eqns = grad_jaxpr(cfg, jnp.zeros((2, 33), jnp.int32)).eqns
    shapes = lambda name: [tuple(e.outvars[0].aval.shape) for e in eqns if e.primitive.name == name]
    assert not stacked & set(shapes("pad"))
    assert stacked <= set(shapes("concatenate"))


@pytest.mark.parametrize("variant", ["mlra4", "gqa", "mla"])
def test_named_remat_policies_keep_what_they_name(variant):
    from jax._src.ad_checkpoint import saved_residuals

    from mlra_jax.model import REMAT_POLICIES, Block, default_positions

    cfg = tiny_model(variant, n_layer=1, vocab_size=256, attention_impl="splash")
    graphdef, state = nnx.split(Block(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    x = jnp.ones((2, 128, cfg.n_embd), jnp.float32)
    positions = default_positions(jnp.zeros((2, 128), jnp.int32))

    def names(remat):
        layer = jax.checkpoint(lambda p, h: nnx.merge(graphdef, p)(h, positions), policy=REMAT_POLICIES[remat])
        return {source.split("'")[1] for _, source in saved_residuals(layer, params, x) if source.startswith("named")}

    assert names("dots_attn") == set()
    assert names("dots_attn_kv") == {"attention_k", "attention_v"}
    assert names("dots_attn_qkv") == {"attention_q", "attention_k", "attention_v"}


def test_every_remat_policy_gives_the_gradients_of_none():
    variant = "mlra4"  # the named policies keep per-head keys and values up-projected from latent blocks
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)
    model = init_model(tiny_model(variant, n_layer=2, vocab_size=256))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def grads(remat):
        cfg = tiny_model(variant, n_layer=2, vocab_size=256, remat=remat)
        graphdef = nnx.split(init_model(cfg))[0]
        return jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, tokens)))(params)

    expected = grads("none")
    for remat in ("dots_attn_qkv", "dots_attn_kv", "dots_attn", "dots", "full"):
        got = grads(remat)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, expected)


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
    assert experiment.model.attention_impl == "auto" and experiment.model.remat == "auto"
    assert experiment.model.scan_layers is False and experiment.train.loss_chunk == 512
    setup = build_setup(experiment)  # 8 CPU devices: 480 / 8 = 60 per device, 6 at a time
    assert setup.experiment.train.micro_batch_size == 48 and setup.experiment.train.accumulation_steps == 10
    assert setup.experiment.model.remat == "none"  # CPU devices report no memory limit


def remat_inputs(**train_changes):
    experiment = micro_experiment(
        "mlra4_tiny",
        *GPT2,  # the sizes that the remat choices below are estimated for
        "--model.remat=auto",
        "--train.seq_len=128",
        "--model.compute_dtype=bfloat16",
        "--model.attention_impl=splash",
        *(f"--train.{k}={v}" for k, v in train_changes.items()),
    )
    return experiment, 10 * 2**20  # 10 MiB of weights and optimizer state


def test_auto_remat_takes_the_least_recomputation_that_fits():
    experiment, fixed = remat_inputs()
    needs = {remat: remat_choice.step_bytes(experiment, fixed, 4, remat) for remat in remat_choice.REMAT_ORDER}
    assert needs["none"] >= needs["dots_attn_qkv"] > needs["dots_attn_kv"] > needs["dots_attn"] > needs["dots"]
    assert needs["dots"] > needs["full"] > fixed
    for need in needs.values():
        chosen, reason = remat_choice.choose_remat(experiment, fixed, 4, int(need / remat_choice.MEMORY_FRACTION) + 1)
        assert chosen == next(r for r in remat_choice.REMAT_ORDER if needs[r] <= need), reason
    chosen, reason = remat_choice.choose_remat(experiment, fixed, 4, fixed)
    assert chosen == "full" and "nothing fits" in reason and "micro_batch_size" in reason
    assert remat_choice.choose_remat(experiment, fixed, 4, None) == ("none", "the device reports no memory limit")
    # twice the sequences per device: more memory for the same choice
    assert remat_choice.step_bytes(experiment, fixed, 8, "none") > needs["none"]


def test_auto_remat_counts_the_products_and_kernel_outputs_not_fused_elementwise_values():
    assert remat_choice.materialized("output of dot_general from x.py:1", jnp.bfloat16, jnp.bfloat16)
    assert remat_choice.materialized("output of jitted function '_splash_attention' from y", jnp.bfloat16, jnp.bfloat16)
    assert remat_choice.materialized("output of convert_element_type from p", jnp.bfloat16, jnp.bfloat16)
    assert not remat_choice.materialized("output of convert_element_type from p", jnp.float32, jnp.bfloat16)
    assert not remat_choice.materialized("output of mul from layers.py:70", jnp.float32, jnp.bfloat16)
    assert not remat_choice.materialized("from the argument h", jnp.float32, jnp.bfloat16)


def test_xla_flags_keep_the_users_values(monkeypatch):
    merged = xla_flags.merged_flags("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1", xla_flags.GPU_FLAGS)
    assert merged.startswith("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1")
    assert merged.count("latency_hiding") == 1 and "--xla_gpu_all_gather_combine_threshold_bytes=" in merged
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    monkeypatch.setattr(xla_flags, "cuda_plugin_installed", lambda: True)
    monkeypatch.setenv(xla_flags.DISABLE_VARIABLE, "0")
    assert not xla_flags.apply_gpu_defaults() and xla_flags.os.environ["XLA_FLAGS"] == "--foo=1"
    monkeypatch.delenv(xla_flags.DISABLE_VARIABLE)
    monkeypatch.delenv(xla_flags.MEMORY_FRACTION_VARIABLE, raising=False)
    assert xla_flags.apply_gpu_defaults() and "latency_hiding_scheduler=true" in xla_flags.os.environ["XLA_FLAGS"]
    assert xla_flags.os.environ[xla_flags.MEMORY_FRACTION_VARIABLE] == xla_flags.GPU_MEMORY_FRACTION
    monkeypatch.setenv(xla_flags.MEMORY_FRACTION_VARIABLE, "0.5")
    assert xla_flags.apply_gpu_defaults() and xla_flags.os.environ[xla_flags.MEMORY_FRACTION_VARIABLE] == "0.5"
    monkeypatch.undo()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not xla_flags.cuda_plugin_installed()  # JAX_PLATFORMS=cpu (the tests): no flags added


@pytest.mark.slow
def test_a_run_resumes_under_other_runtime_settings_but_not_another_model(tmp_path):
    devices = jax.devices()[:1]
    train(
        micro_experiment("mlra4_tiny", "--train.total_steps=4", "--train.eval_every=0", "--model.attention_impl=xla"),
        tmp_path,
        devices=devices,
    )
    result = train(
        micro_experiment(
            "mlra4_tiny",
            "--train.total_steps=8",
            "--train.eval_every=0",
            "--model.remat=dots_attn",
            "--model.scan_layers=false",
        ),
        tmp_path,
        devices=devices,
        allow_changed=("train.total_steps",),
    )
    assert result.step == 8
    with pytest.raises(ConfigError, match="model.n_embd was 64, now 32"):
        train(micro_experiment("mlra4_tiny", "--model.n_embd=32"), tmp_path, devices=devices)


def test_auto_remat_takes_a_smaller_micro_batch_before_rerunning_products(monkeypatch):
    """With the micro-batch from the per-device cap, a memory where 8 sequences per device fit only under `dots`
    (which reruns the attention) but 4 fit under dots_attn takes 4 (twice the accumulation steps); an explicit
    micro_batch_size is kept."""
    experiment, fixed = remat_inputs(global_batch_size=16, max_micro_batch_per_device=8, micro_batch_size="none")
    setup = build_setup(
        dataclasses.replace(experiment, model=dataclasses.replace(experiment.model, remat="none")), jax.devices()[:1]
    )
    fixed = state_bytes(setup)
    memory = int(remat_choice.step_bytes(experiment, fixed, 4, "dots_attn") / remat_choice.MEMORY_FRACTION) + 1
    assert remat_choice.choose_remat(experiment, fixed, 8, memory)[0] in ("dots", "full")
    monkeypatch.setattr(remat_choice, "device_memory", lambda device: memory)
    resolved = build_setup(experiment, jax.devices()[:1]).experiment
    assert (resolved.train.micro_batch_size, resolved.train.accumulation_steps) == (4, 4)
    assert resolved.model.remat == remat_choice.choose_remat(experiment, fixed, 4, memory)[0]
    assert resolved.model.remat in remat_choice.LIGHT_POLICIES
    explicit = dataclasses.replace(experiment, train=dataclasses.replace(experiment.train, micro_batch_size=8))
    assert build_setup(explicit, jax.devices()[:1]).experiment.model.remat in ("dots", "full")
    # where 8 fit under a light policy, the cap's micro-batch stays
    roomy = int(remat_choice.step_bytes(experiment, fixed, 8, "dots_attn") / remat_choice.MEMORY_FRACTION) + 1
    monkeypatch.setattr(remat_choice, "device_memory", lambda device: roomy)
    resolved = build_setup(experiment, jax.devices()[:1]).experiment
    assert resolved.train.micro_batch_size == 8 and resolved.model.remat in remat_choice.LIGHT_POLICIES


def test_auto_remat_compiles_to_confirm_an_estimate_just_over_the_budget(monkeypatch):
    """An estimate over the budget by at most CONFIRM_MARGIN is checked against XLA's count of the compiled step,
    in REMAT_ORDER; one further over, or one within the budget, compiles nothing."""
    experiment, fixed = remat_inputs()
    budget = 100 * 2**20
    memory = budget / remat_choice.MEMORY_FRACTION
    needs = {"none": 130, "dots_attn_qkv": 120, "dots_attn_kv": 112, "dots_attn": 104, "dots": 90, "full": 80}
    assert 100 * remat_choice.CONFIRM_MARGIN == pytest.approx(115)  # kv and dots_attn are near, qkv and none not
    monkeypatch.setattr(remat_choice, "step_bytes", lambda exp, fixed, batch, remat: needs[remat] * 2**20)

    def compiler(size):
        calls = []
        return calls, lambda remat: calls.append(remat) or size

    calls, compiled = compiler(int(remat_choice.COMPILED_FRACTION * memory))
    chosen, reason = remat_choice.choose_remat(experiment, fixed, 4, memory, compiled)
    assert (chosen, calls) == ("dots_attn_kv", ["dots_attn_kv"]) and "compiled step fits" in reason, reason
    calls, compiled = compiler(int(remat_choice.COMPILED_FRACTION * memory) + 1)  # XLA's count does not fit either
    chosen, reason = remat_choice.choose_remat(experiment, fixed, 4, memory, compiled)
    assert (chosen, calls) == ("dots", ["dots_attn_kv", "dots_attn"]) and "compiled" in reason, reason
    calls, compiled = compiler(None)  # a backend without memory analysis: the estimate decides
    assert remat_choice.choose_remat(experiment, fixed, 4, memory, compiled) == remat_choice.choose_remat(
        experiment, fixed, 4, memory
    )
    calls, compiled = compiler(0)
    assert remat_choice.choose_remat(experiment, fixed, 4, 131 * 2**20 / 0.9, compiled)[0] == "none" and calls == []


def test_auto_remat_confirms_with_the_compiled_step_of_the_candidate(monkeypatch):
    """On a device that compiles_to_confirm, build_setup compiles the candidate experiment's real step: with every
    estimate over the budget but within the margin, the compiled step (far smaller on the CPU) decides for none,
    where the estimate alone takes a smaller micro-batch or more recomputation."""
    experiment, _ = remat_inputs(global_batch_size=8, max_micro_batch_per_device=8, micro_batch_size="none")
    devices = jax.devices()[:1]
    fixed = state_bytes(build_setup(experiment, devices))
    memory = int(remat_choice.step_bytes(experiment, fixed, 8, "none") / remat_choice.MEMORY_FRACTION / 1.1)
    monkeypatch.setattr(remat_choice, "device_memory", lambda device: memory)
    assert not remat_choice.compiles_to_confirm(devices[0])
    estimated = build_setup(experiment, devices).experiment  # CPU: no compiling to confirm
    assert (estimated.model.remat, estimated.train.micro_batch_size) != ("none", 8)
    monkeypatch.setattr(remat_choice, "compiles_to_confirm", lambda device: True)
    confirmed = build_setup(experiment, devices).experiment
    assert (confirmed.model.remat, confirmed.train.micro_batch_size) == ("none", 8)


def test_auto_remat_gathers_fsdp_weights_once_per_step_where_the_compiled_step_fits(monkeypatch):
    """Under FSDP with accumulation, a recomputing choice is compiled with the weights gathered once per step,
    under it and then each heavier light policy; the first that fits is taken, else the weights are gathered in
    each micro-batch. Off an FSDP mesh, or with mesh.fsdp_gather given, nothing more is compiled."""
    experiment, _ = remat_inputs(global_batch_size=16, micro_batch_size=4)
    experiment = dataclasses.replace(experiment, mesh=dataclasses.replace(experiment.mesh, data=1, fsdp=2))
    devices = jax.devices()[:2]
    needs = {"none": 130, "dots_attn_qkv": 120, "dots_attn_kv": 99, "dots_attn": 90, "dots": 80, "full": 70}
    monkeypatch.setattr(remat_choice, "step_bytes", lambda exp, fixed, batch, remat: needs[remat] * 2**20)
    monkeypatch.setattr(remat_choice, "device_memory", lambda device: 100 * 2**20 / remat_choice.MEMORY_FRACTION)
    monkeypatch.setattr(remat_choice, "compiles_to_confirm", lambda device: True)
    compiled = []
    peaks = {}

    def recording(setup):  # XLA's count, as the test sets it (the compiling itself is tested above)
        model, mesh = setup.experiment.model, setup.experiment.mesh
        compiled.append((model.remat, mesh.fsdp_gather))
        return peaks.get((model.remat, mesh.fsdp_gather), 2**20)

    monkeypatch.setattr(state, "compiled_peak", recording)
    peaks[("dots_attn_kv", "step")] = 2**40  # too large: the next policy is tried
    setup = build_setup(experiment, devices)
    assert (setup.experiment.model.remat, state.fsdp_gather(setup)) == ("dots_attn", "step")
    assert compiled == [("dots_attn_kv", "step"), ("dots_attn", "step")]
    peaks[("dots_attn", "step")] = 2**40  # nothing fits held: gathered in each micro-batch under the first choice
    compiled.clear()
    setup = build_setup(experiment, devices)
    assert (setup.experiment.model.remat, state.fsdp_gather(setup)) == ("dots_attn_kv", "micro_batch")
    assert compiled == [("dots_attn_kv", "step"), ("dots_attn", "step")]
    compiled.clear()
    given = dataclasses.replace(experiment, mesh=dataclasses.replace(experiment.mesh, fsdp_gather="micro_batch"))
    assert build_setup(given, devices).experiment.model.remat == "dots_attn_kv" and compiled == []
    one_device = dataclasses.replace(experiment, mesh=dataclasses.replace(experiment.mesh, fsdp=1))
    assert build_setup(one_device, devices[:1]).experiment.model.remat == "dots_attn_kv" and compiled == []


def test_auto_remat_stops_compiling_after_its_limit_and_lets_the_estimates_decide():
    compiled = []
    limited = remat_choice.at_most(2, lambda candidate: compiled.append(candidate) or 7)
    assert [limited(name) for name in "abcd"] == [7, 7, None, None] and compiled == ["a", "b"]
