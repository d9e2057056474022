"""FP8 training attention (mlra_jax.attention.fp8_attention) on the CPU, where the jnp reference of cuDNN's FP8
graphs stands in for the kernels (INTERPRET): its output and gradients against float32 attention within FP8's
rounding, the scales from the history and the history's update, the sharding around the kernels, a GQA train step
with its attention in FP8 (histories in the train state, micro-batches merged, old checkpoints restored) and where
the attention stays in the compute dtype. The GPU tests run cuDNN's FP8 attention against the reference and in a
GQA train step."""

import dataclasses
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, traverse_util
from helpers import SMALL_VOCAB, micro_experiment, on_gpu
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax import fp8
from mlra_jax.attention import fp8_attention
from mlra_jax.attention.core import causal_mask, xla_attention
from mlra_jax.attention.fused import kernels_chosen
from mlra_jax.model import fp8_histories, init_model
from mlra_jax.training.step import loss_fn, make_train_step

SITE = fp8_attention.SITE
ONE_DEVICE = jax.devices()[:1]
FLOAT8 = ("--model.compute_dtype=bfloat16", "--model.matmul_dtype=float8", "--model.fp8_attention=true")


@pytest.fixture
def stand_in(monkeypatch):
    """FP8 GEMMs pretended available, the reference in cuDNN's place, a history of 4 steps (the rolling shows)."""
    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    monkeypatch.setattr(fp8_attention, "INTERPRET", True)
    monkeypatch.setattr(fp8, "HISTORY", 4)


def _inputs(kv_heads: int = 2, batch: int = 2, length: int = 128, heads: int = 4, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(batch, length, heads, 128), (batch, length, kv_heads, 128), (batch, length, kv_heads, 128)]
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in zip(keys, shapes))
    do = jax.random.normal(keys[3], shapes[0], jnp.float32).astype(jnp.bfloat16)
    return q, k, v, do


def _fp8_vjp(q, k, v, do, history):
    out, pullback = jax.vjp(lambda *x: fp8_attention.fp8_attention(*x, 128**-0.5), q, k, v, history)
    return (out, *pullback(do))


def _float32_vjp(q, k, v, do):
    """Float32 attention's output and gradients, and the gradient of its unscaled logits Q K^T (cuDNN's dS)."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    attend = lambda q, k, v: xla_attention(q, k, v, scale=128**-0.5, mask=causal_mask(positions, positions))  # noqa: E731
    with jax.default_matmul_precision("highest"):
        out, pullback = jax.vjp(attend, *f32[:3])
        grads = pullback(f32[3])
        b, t, h, d = q.shape
        groups = h // k.shape[2]
        qg = f32[0].reshape(b, t, k.shape[2], groups, d)
        raw = jnp.einsum("btkgd,bskd->bkgts", qg, f32[1])

        def from_logits(raw):
            logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), raw * 128**-0.5, -jnp.inf)
            probs = jax.nn.softmax(logits, axis=-1)
            return jnp.einsum("bkgts,bskd->btkgd", probs, f32[2]).reshape(b, t, h, d)

        d_raw = jax.vjp(from_logits, raw)[1](f32[3])[0]
    return out, grads, d_raw


def _calibrated(q, k, v, do):
    """The history after one call on these inputs: scales from their own amaxes, as a run's steps have them."""
    return _fp8_vjp(q, k, v, do, fp8_attention.new_history(4))[4]


relative = lambda got, want: float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))  # noqa: E731


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_the_reference_is_float32_attention_within_fp8_rounding(kv_heads, monkeypatch):
    """e4m3 keeps 3 mantissa bits, and each of q, k, v, P and O (dO, dS, dQ, dK, dV) is rounded to it: output
    and gradients within several percent of the norm (about 5% here), in the inputs' dtype."""
    monkeypatch.setattr(fp8_attention, "INTERPRET", True)
    q, k, v, do = _inputs(kv_heads)
    out, dq, dk, dv, _ = _fp8_vjp(q, k, v, do, _calibrated(q, k, v, do))
    want, want_grads, _ = _float32_vjp(q, k, v, do)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16
    assert relative(out, want) < 0.08
    for got, ref in zip((dq, dk, dv), want_grads):
        assert 0 < relative(got, ref) < 0.1


def test_the_history_rolls_and_records_the_tensors_amaxes(monkeypatch):
    """Row by row (fp8_attention.ROWS): q, k, v and dO exactly; P's is 1 (a causal row's first key); O, dS, dQ, dK
    and dV within FP8 rounding of float32 attention's; the older amaxes one place older."""
    monkeypatch.setattr(fp8_attention, "INTERPRET", True)
    q, k, v, do = _inputs(2, seed=1)
    history = _calibrated(q, k, v, do) * jnp.linspace(1.0, 0.5, 4)  # older steps' amaxes differ
    *_, updated = _fp8_vjp(q, k, v, do, history)
    assert updated.shape == (10, 4) and updated.dtype == jnp.float32
    np.testing.assert_array_equal(updated[:, 1:], history[:, :-1])
    amax = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32))))  # noqa: E731
    newest = dict(zip(fp8_attention.ROWS, map(float, updated[:, 0])))
    for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
        assert newest[name] == amax(x)
    assert newest["s"] == 1.0
    out, (dq, dk, dv), d_raw = _float32_vjp(q, k, v, do)
    for name, x in (("o", out), ("dp", d_raw), ("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(newest[name], amax(x), rtol=0.1, err_msg=name)


def test_the_reference_quantizes_each_rows_exponentials_before_normalizing_them():
    """As a flash kernel does (cuDNN on an H200 saturated so: the GPU saturation test), P is quantized before the
    division by the row's sum: each row's largest exponential is 1, so with amax_s halved every row saturates and
    its output changes, although most normalized probabilities of a 128-token causal row are far below 0.5."""
    q, k, v, _ = _inputs(2, seed=3)
    history = jnp.ones((len(fp8_attention.ROWS), 1), jnp.float32).at[:3, 0].set(4.0)
    quantized = [fp8.quantize(x, jnp.float32(4.0 / 448), fp8.E4M3) for x in (q, k, v)]

    def output(amax_s: float) -> jax.Array:
        params = fp8_attention.kernel_params(fp8_attention._scales(history.at[3, 0].set(amax_s)))
        return fp8_attention.reference_forward(*quantized, params, 128**-0.5)[0].astype(jnp.float32)

    changed = jnp.any(output(1.0) != output(0.5), axis=-1)  # [B, T, H]
    assert float(jnp.mean(changed)) > 0.9


def test_the_scales_come_from_the_history_before_the_tensors_are_read(monkeypatch):
    """The kernel gets q, k and v quantized with their rows' largest amax / 448 and cuDNN's scales as their
    inverses; a fresh history scales by 1 and saturates at 448."""
    monkeypatch.setattr(fp8_attention, "INTERPRET", True)
    seen, reference = {}, fp8_attention.reference_forward

    def forward(q8, k8, v8, params, scale):
        seen.update(q8=q8, params=params)
        return reference(q8, k8, v8, params, scale)

    monkeypatch.setattr(fp8_attention, "reference_forward", forward)
    q, k, v, do = _inputs(2, seed=2)
    history = _calibrated(q, k, v, do) * jnp.linspace(0.5, 1.0, 4)  # the largest amax is the oldest
    jax.block_until_ready(_fp8_vjp(q, k, v, do, history))
    scales = {name: float(jnp.max(row)) / 448.0 for name, row in zip(fp8_attention.ROWS, history)}
    params = {name: float(value.reshape(())) for name, value in seen["params"].items()}
    for name in ("q", "k", "v", "s"):
        np.testing.assert_allclose(params[f"descale_{name}"], scales[name], rtol=1e-6)
    for name, row in (("s", "s"), ("o", "o"), ("dP", "dp"), ("dQ", "dq"), ("dK", "dk"), ("dV", "dv")):
        np.testing.assert_allclose(params[f"scale_{name}"], 1 / scales[row], rtol=1e-6)
    want = fp8.quantize(q, jnp.float32(scales["q"]), fp8.E4M3)
    np.testing.assert_array_equal(seen["q8"].astype(jnp.float32), want.astype(jnp.float32))

    jax.block_until_ready(_fp8_vjp(q * 1000, k, v, do, fp8_attention.new_history(4)))
    assert {float(value.reshape(())) for name, value in seen["params"].items() if "scale" in name} == {1.0}
    assert float(jnp.max(jnp.abs(seen["q8"].astype(jnp.float32)))) == 448.0


@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA (KV heads split over `tensor`), MQA (one KV head, kept whole)
def test_on_a_mesh_each_device_runs_its_shard_with_the_whole_calls_scales(kv_heads, monkeypatch):
    """On 8 CPU devices (data 4, tensor 2) the kernels run per shard: the output, dQ and the history are the
    unsharded call's; MQA's dK and dV sum the devices' parts (each quantized on its own: FP8 rounding)."""
    from mlra_jax.config import MeshConfig
    from mlra_jax.sharding import make_mesh

    monkeypatch.setattr(fp8_attention, "INTERPRET", True)
    q, k, v, do = _inputs(kv_heads, batch=4, seed=3)
    history = _calibrated(q, k, v, do)
    want = jax.jit(_fp8_vjp)(q, k, v, do, history)
    mesh = make_mesh(MeshConfig(data=-1, tensor=2), jax.devices()[:8])
    with jax.set_mesh(mesh):
        got = jax.jit(_fp8_vjp)(q, k, v, do, history)
    out, dq, dk, dv, updated = got
    np.testing.assert_allclose(out.astype(jnp.float32), want[0].astype(jnp.float32), atol=1e-2)
    np.testing.assert_allclose(dq.astype(jnp.float32), want[1].astype(jnp.float32), atol=1e-2)
    rtol = 1e-2 if kv_heads > 1 else 0.05
    for got_grad, want_grad in zip((dk, dv), want[2:4]):
        assert relative(got_grad, want_grad.astype(jnp.float32)) < rtol
    np.testing.assert_allclose(updated[:8], want[4][:8], rtol=1e-2)  # q, k, v, P, O, dO, dS, dQ: the whole call's
    if kv_heads > 1:
        np.testing.assert_allclose(updated[8:], want[4][8:], rtol=1e-2)
    else:  # the largest amax of the devices' parts of dK and dV: what each device's kernel quantized
        assert bool((updated[8:, 0] > 0).all())


def _gqa(**changes):
    """A tiny GQA whose heads cuDNN's FP8 attention trains (128 wide), FP8 matmuls with delayed scaling."""
    fields = dict(n_layer=2, head_dim=128, vocab_size=SMALL_VOCAB, output_init="normal")
    cfg = tiny_model("gqa", **{**fields, **changes})
    return dataclasses.replace(cfg, compute_dtype="bfloat16", matmul_dtype="float8", fp8_attention=True)


def _split(cfg):
    graphdef, state = nnx.split(init_model(cfg, seed=0))
    return graphdef, nnx.to_pure_dict(state)


def test_a_gqa_step_trains_its_attention_in_fp8(stand_in):
    """The attention module's site is in the train state beside its projections; a step runs the core in FP8
    (recorded as cudnn_fp8) and rolls its history; from fresh histories the second step fills every row (the
    first, at scale 1, flushes dS to zero: its dQ and dK are zero); the loss stays near bf16's."""
    cfg = _gqa()
    graphdef, params = _split(cfg)
    histories = fp8_histories(cfg)
    attention = histories["blocks"]["attn"]
    assert set(attention) == {"q_proj", "k_proj", "v_proj", "o_proj", SITE}
    assert attention[SITE].shape == (2, 10, 4) and attention["q_proj"].shape == (2, 3, 4)
    tokens = jax.random.randint(jax.random.key(1), (2, 129), 0, cfg.vocab_size)
    step = jax.jit(make_train_step(graphdef, optax.sgd(0.0)))
    state = (params, optax.sgd(0.0).init(params))
    with kernels_chosen() as chosen:
        step.lower(*state, histories, tokens)
    assert chosen == {"cudnn_fp8": 1}  # the scanned layer's attention, traced once
    _, _, first, _ = step(*state, histories, tokens)
    _, _, second, metrics = step(*state, first, tokens)
    site, newer = first["blocks"]["attn"][SITE], second["blocks"]["attn"][SITE]
    assert bool((site[:, :7, 0] > 0).all()) and not site[:, :, 1:].any()  # q, k, v, P, O, dO, dS
    assert bool(metrics["finite"]) and bool((newer[:, :, 0] > 0).all())
    np.testing.assert_array_equal(site[:, fp8_attention.ROWS.index("s"), 0], [1.0, 1.0])
    np.testing.assert_array_equal(newer[:, :, 1], site[:, :, 0])
    loss = float(metrics["loss"])
    bf16_graphdef, _ = _split(dataclasses.replace(cfg, matmul_dtype="compute"))
    want = float(loss_fn(bf16_graphdef, params, tokens))
    assert abs(loss - want) < 0.02 * want


def test_micro_batches_merge_the_attention_amaxes(stand_in):
    cfg = _gqa(n_layer=1)
    graphdef, params = _split(cfg)
    tokens = jax.random.randint(jax.random.key(2), (4, 129), 0, cfg.vocab_size)
    state = (params, optax.sgd(0.0).init(params), fp8_histories(cfg))
    split = jax.jit(make_train_step(graphdef, optax.sgd(0.0), accumulation_steps=2))(*state, tokens)[2]
    whole = jax.jit(make_train_step(graphdef, optax.sgd(0.0)))
    parts = [whole(*state, tokens[i::2])[2] for i in range(2)]  # micro-batch i: rows i, i + 2 (micro_batches)
    got, a, b = (x["blocks"]["attn"][SITE] for x in (split, *parts))
    assert bool((got[:, :7, 0] > 0).all())
    np.testing.assert_allclose(got, jnp.maximum(a, b), rtol=1e-6)


@pytest.mark.slow
def test_remat_and_unrolled_layers_give_the_same_step(stand_in):
    """Under remat policies (those that keep the FP8 kernel's output or recompute it) and with the layers
    unrolled, the loss and the updated histories are the scanned step's without remat (the amaxes up to the FP8
    rounding of bf16 values that other fusions round apart: a gradient's by up to 20%)."""
    cfg = _gqa()
    tokens = jax.random.randint(jax.random.key(5), (2, 129), 0, cfg.vocab_size)
    histories = jax.tree.map(lambda h: h + 1.0, fp8_histories(cfg))  # scales of 1 / 448 (amaxes of 1)

    def step(cfg):
        graphdef, params = _split(cfg)
        grad = jax.value_and_grad(lambda p, h: loss_fn(graphdef, p, tokens, training=True, histories=h), argnums=1)
        return jax.jit(grad)(params, histories)

    loss, updated = step(cfg)
    for changes in (dict(remat="dots_attn"), dict(remat="full"), dict(scan_layers=False)):
        other_loss, other = step(dataclasses.replace(cfg, **changes))
        np.testing.assert_allclose(float(other_loss), float(loss), rtol=1e-3, err_msg=str(changes))
        for got, want in zip(jax.tree.leaves(other), jax.tree.leaves(updated)):
            np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])  # rolled
            assert bool(((got[:, :, 0] > 0) == (want[:, :, 0] > 0)).all())
            np.testing.assert_allclose(got, want, rtol=0.25, err_msg=str(changes))


@pytest.mark.slow
def test_the_interleaved_benchmark_compares_fp8_attention_on_and_off(tmp_path, stand_in):
    """Each side keeps FP8 histories of its own: the one without FP8 attention has none for the attention core."""
    import json

    from mlra_jax.benchmarks import interleaved

    out = tmp_path / "ab.json"
    both = ["--model.vocab_size=512", "--model.head_dim=128", *FLOAT8]
    interleaved.main(
        ["--experiment=gqa_tiny", "--n_layer=1", "--seq_len=128", "--batch_per_device=1", "--pairs=2", "--warmup=1"]
        + [f"--a={o}" for o in (*both, "--model.fp8_attention=false")]
        + [f"--b={o}" for o in both]
        + [f"--out={out}"]
    )
    (result,) = json.loads(out.read_text())["results"]
    assert [len(result["step_times_s"][side]) for side in ("a", "b")] == [2, 2]


def test_the_attention_kernels_benchmark_times_fp8_beside_bf16(monkeypatch, stand_in):
    """The cudnn_fp8 rows (here: the reference for cuDNN's FP8, XLA for its bf16, a fixed time for the profiler):
    bf16 and FP8, forward and forward + backward, with the layer's KV heads, errors and speed-ups."""
    from mlra_jax.experiments import registry

    from mlra_jax.benchmarks import attention_kernels

    experiment = registry.get_experiment("gqa_tiny")
    model = dataclasses.replace(experiment.model, head_dim=128)
    train = dataclasses.replace(experiment.train, seq_len=128)
    monkeypatch.setitem(registry._EXPERIMENTS, "gqa_tiny", dataclasses.replace(experiment, model=model, train=train))
    positions = jnp.broadcast_to(jnp.arange(128), (1, 128))
    xla = lambda q, k, v, scale: xla_attention(q, k, v, scale=scale, mask=causal_mask(positions, positions))  # noqa: E731
    monkeypatch.setattr(attention_kernels, "cudnn_attention", xla)
    timing = {"time_s": 1e-3, "kernels_s": {"attention": 1e-3}, "timeline": [("attention", 0.0, 1e3)]}
    monkeypatch.setattr(attention_kernels, "profiled_time", lambda fn, repeats: (fn(), timing)[1])
    rows = attention_kernels.case_rows("gqa_tiny", 1, 1, ("cudnn_fp8",))
    assert [(r["kernel"], r["passes"]) for r in rows] == [
        ("cudnn", "forward"),
        ("cudnn", "forward+backward"),
        ("cudnn_fp8", "forward"),
        ("cudnn_fp8", "forward+backward"),
    ]
    assert {r["layout"] for r in rows} == {"4 query heads over 2 KV heads"}
    forward, backward = rows[2:]
    assert forward["speedup_vs_cudnn"] == 1.0 and forward["relative_error_out_vs_cudnn"] < 0.08
    assert all(backward[f"relative_error_{name}_vs_cudnn"] < 0.1 for name in ("dq", "dk", "dv"))
    assert len(forward["history"]) == 10 and min(forward["history"]) > 0


def _fallback_logs(caplog, cfg, length: int, histories=True):
    fp8_attention._report_fallback.cache_clear()
    graphdef, params = _split(cfg)
    tokens = jax.random.randint(jax.random.key(3), (2, length + 1), 0, cfg.vocab_size)
    grad = jax.jit(jax.grad(lambda p, h: loss_fn(graphdef, p, tokens, training=True, histories=h), argnums=1))
    with caplog.at_level(logging.WARNING, logger="mlra_jax.attention.fp8_attention"), kernels_chosen() as chosen:
        updated = grad(params, fp8_histories(cfg) if histories else {})
    return updated, chosen


def test_a_hopper_gpu_runs_it_only_under_the_jax_whose_backward_order_was_checked(monkeypatch):
    """The backward's scale operands go in the order XLA reads them (BACKWARD_SCALE_ORDER), checked against float32
    attention on jax 0.11 (a GPU test): under another JAX the core stays in the compute dtype, saying why."""
    hopper = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")
    cudnn = types.SimpleNamespace(
        check_cudnn_version=lambda: 91400, _dot_product_attention_fp8_fwd_rule=None, fp8_params_keys_bwd=()
    )
    monkeypatch.setattr(fp8_attention, "target_platform", lambda: "gpu")
    monkeypatch.setattr(fp8_attention, "cudnn_module", lambda: cudnn)
    monkeypatch.setattr(jax, "__version__", "0.11.2")
    assert fp8_attention.device_problem(hopper) is None
    monkeypatch.setattr(jax, "__version__", "0.12.0")
    reason = fp8_attention.device_problem(hopper)
    assert "not checked against float32 attention on jax 0.12.0" in reason and "0.11.x" in reason
    assert fp8_attention.BACKWARD_SCALE_ORDER[3:6] == ("descale_s", "descale_o", "descale_dO")
    assert sorted(fp8_attention.BACKWARD_SCALE_ORDER) == sorted(
        name
        for name in fp8_attention.kernel_params({row: jnp.float32(1) for row in fp8_attention.ROWS})
        if not name.startswith(("amax", "scale_o"))
    )


def test_where_fp8_attention_cannot_run_the_core_stays_in_bf16_and_says_why(caplog, monkeypatch):
    """The site's history is the model's whatever the device; where the kernel cannot run (here a CPU, then a
    sequence that is not a multiple of 128, then dynamic scaling) the step says why once and its core runs as
    in bf16 (the history, unused, comes back zeros)."""
    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    cfg = _gqa(n_layer=1)
    updated, chosen = _fallback_logs(caplog, cfg, 128)
    assert "the attention core stays in the compute dtype: cuDNN's FP8 attention needs an NVIDIA GPU" in caplog.text
    assert "cudnn_fp8" not in chosen and not updated["blocks"]["attn"][SITE].any()
    monkeypatch.setattr(fp8_attention, "INTERPRET", True)
    caplog.clear()
    _, chosen = _fallback_logs(caplog, cfg, 64)
    assert "trains sequences of a multiple of 128 tokens, not 64" in caplog.text and "cudnn_fp8" not in chosen
    caplog.clear()
    _, chosen = _fallback_logs(caplog, dataclasses.replace(cfg, fp8_scaling="dynamic"), 128, histories=False)
    assert "FP8 attention takes delayed scaling" in caplog.text and "cudnn_fp8" not in chosen


def _float8(cfg):
    return dataclasses.replace(cfg, compute_dtype="bfloat16", matmul_dtype="float8")


@pytest.mark.parametrize(
    "cfg,sites",
    [
        (tiny_model("mha", n_layer=1, head_dim=128, fp8_attention=True), 1),
        (tiny_model("mqa", n_layer=1, head_dim=128, fp8_attention=True), 1),
        (tiny_model("tpa", n_layer=1, head_dim=128, fp8_attention=True), 1),
        (tiny_model("gta", n_layer=1, head_dim=128, fp8_attention=True), 1),
        (tiny_model("gqa", n_layer=1, fp8_attention=True), 0),  # 32 wide
        (tiny_model("mlra4", n_layer=1, fp8_attention=True), 0),  # the latent family: keys wider than values
        (tiny_model("mfa", n_layer=1, head_dim=256, fp8_attention=True), 0),
        (tiny_model("gqa", n_layer=1, head_dim=128, attention_impl="xla", fp8_attention=True), 0),
        (tiny_model("gqa", n_layer=1, head_dim=128), 0),  # the default
    ],
    ids=["mha", "mqa", "tpa", "gta", "gqa_32", "mlra4", "mfa_256", "attention_impl_xla", "default_off"],
)
def test_which_models_have_an_fp8_attention_site(cfg, sites):
    """Decided by the model alone (not the device, nor the sequence length): the train state's layout."""
    assert fp8_attention.sites(fp8_histories(_float8(cfg))) == sites
    assert not tiny_model("gqa", n_layer=1, head_dim=128).fp8_attention  # off unless asked for


def test_dry_run_says_how_the_attention_core_runs(capsys):
    from mlra_jax.train import main as train_main

    gqa = ("--experiment=gqa_tiny", "--model.head_dim=128", *FLOAT8, "--dry_run")
    assert train_main(list(gqa)) == 0
    out = capsys.readouterr().out
    assert "attention core: float8 asked for, but cuDNN's FP8 attention needs an NVIDIA GPU" in out
    assert "7 projections x 4 layers x 3 tensors (x, w, gradient) and 1 attention cores x 4 layers x 10 tensors" in out
    assert train_main([*gqa, "--model.fp8_attention=false"]) == 0
    assert "attention core: the compute dtype (model.fp8_attention=false)" in capsys.readouterr().out
    assert train_main(["--experiment=mlra4_tiny", *FLOAT8, "--dry_run"]) == 0
    assert "this model's are not" in capsys.readouterr().out

    class Hopper:
        platform, device_kind, compute_capability = "cpu", "H100", "9.0"

    cfg = _gqa()
    line = fp8_attention.describe(cfg, fp8_histories(cfg), 100, Hopper())
    assert "multiples of 128 tokens, not 100" in line


@pytest.mark.slow
def test_a_checkpoint_with_projection_histories_only_restores_them(tmp_path, caplog):
    """A state saved before the attention cores had histories (its FP8 entry: the projections' only) restores the
    projections' bit for bit; the attention cores' start fresh (logged); a damaged attention history is reset."""
    from mlra_jax.checkpoint import Checkpointer
    from mlra_jax.training.loop import TrainingLoop
    from mlra_jax.training.resume_check import record_experiment
    from mlra_jax.training.state import build_setup, init_state

    experiment = micro_experiment(
        "gqa_tiny", *FLOAT8, "--model.head_dim=128", "--train.eval_every=0", "--train.warmup_steps=1"
    )
    setup = build_setup(experiment, ONE_DEVICE)
    state = init_state(setup)
    flat = traverse_util.flatten_dict(state["fp8"])
    assert any(path[-1] == SITE for path in flat)
    old = {
        path: jnp.full(h.shape, 1.0 + i, jnp.float32) for i, (path, h) in enumerate(flat.items()) if path[-1] != SITE
    }
    checkpointer = Checkpointer(tmp_path / "checkpoints", experiment.checkpoint)
    metadata = {"step": 2, "examples": 2 * experiment.train.global_batch_size, "experiment": "x"}
    checkpointer.save(2, {**state, "fp8": traverse_util.unflatten_dict(old)}, metadata)
    checkpointer.close()
    record_experiment(tmp_path, experiment)

    def restored():
        with caplog.at_level("INFO"), jax.set_mesh(setup.mesh):
            loop = TrainingLoop(setup, tmp_path)  # restores the newest step (nothing is compiled or trained)
            loop.checkpointer.close()
            loop.writer.close()
        return loop

    loop = restored()
    assert loop.step == 2 and "restored the 7 of the same path and shape" in caplog.text
    assert f"step 2 starts fresh FP8 scales for blocks.attn.{SITE}" in caplog.text
    got = traverse_util.flatten_dict(loop.state["fp8"])
    assert set(got) == set(flat)
    for path, history in got.items():
        np.testing.assert_array_equal(history, old[path] if path in old else jnp.zeros_like(flat[path]))

    damaged = dict(traverse_util.flatten_dict(loop.state["fp8"]))
    damaged[("blocks", "attn", SITE)] = damaged[("blocks", "attn", SITE)].at[0, 6, 0].set(jnp.inf)
    checkpointer = Checkpointer(tmp_path / "checkpoints", experiment.checkpoint)
    checkpointer.save(4, {**loop.state, "fp8": traverse_util.unflatten_dict(damaged)}, {**metadata, "step": 4})
    checkpointer.close()
    caplog.clear()
    loop = restored()
    assert loop.step == 4 and f"blocks.attn.{SITE} in checkpoint 4 hold NaN" in caplog.text
    assert not loop.state["fp8"]["blocks"]["attn"][SITE].any()


# ----------------------------------------------------------------------------- on a GPU
def _needs_cudnn_fp8():
    reason = fp8_attention.device_problem()
    if reason is not None:
        pytest.skip(reason)


@on_gpu
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_cudnn_fp8_attention_is_the_reference(kv_heads, monkeypatch):
    """cuDNN's FP8 forward and backward against the jnp reference of its graphs on the same FP8 inputs and scales:
    the output, the gradients and the history's amaxes within the kernels' rounding (online softmax, tiles)."""
    _needs_cudnn_fp8()
    q, k, v, do = _inputs(kv_heads, batch=2, length=256, heads=8, seed=4)
    history = _calibrated(q, k, v, do)
    got = jax.jit(_fp8_vjp)(q, k, v, do, history)
    want = _on_the_reference(monkeypatch, q, k, v, do, history)
    errors = {name: relative(g, w.astype(jnp.float32)) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    for name, g in zip(("out", "dq", "dk", "dv"), got[:4]):
        assert g.dtype == jnp.bfloat16 and bool(jnp.isfinite(g.astype(jnp.float32)).all()), name
        assert errors[name] < 0.05, errors
    np.testing.assert_allclose(got[4], want[4], rtol=0.05)
    float32_out, float32_grads, _ = _float32_vjp(q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got[:4], (float32_out, *float32_grads)):
        assert relative(g, w) < (0.08 if name == "out" else 0.1), name  # e4m3: q, k, v, P, O; dO and dS too


def _on_the_reference(monkeypatch, q, k, v, do, history):
    """_fp8_vjp with the jnp reference in cuDNN's place, traced anew: jit's caches would otherwise hand back the
    trace of the cuDNN kernels (the switch is a module attribute, not an argument). They are cleared again after
    it, so that no later call takes the reference's trace for cuDNN's."""
    monkeypatch.setattr(fp8_attention, "INTERPRET", True)
    jax.clear_caches()
    want = jax.jit(lambda *args: _fp8_vjp(*args))(q, k, v, do, history)
    jax.clear_caches()
    return want


@on_gpu
def test_cudnn_fp8_attention_saturates_values_above_the_historys_amaxes(monkeypatch):
    """A history below this step's amaxes (they grow between steps) saturates O, dS, dQ, dK and dV at e4m3's
    largest value inside the kernels, as the reference does, instead of overflowing to NaN."""
    _needs_cudnn_fp8()
    q, k, v, do = _inputs(2, batch=2, length=256, heads=8, seed=5)
    low = _calibrated(q, k, v, do) * 0.5
    got = jax.jit(_fp8_vjp)(q, k, v, do, low)
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in got), "cuDNN's FP8 conversions overflowed"
    want = _on_the_reference(monkeypatch, q, k, v, do, low)
    errors = {name: relative(g, w.astype(jnp.float32)) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    assert max(errors.values()) < 0.1, errors


@on_gpu
def test_a_gqa_step_runs_cudnn_fp8_attention():
    """On a Hopper GPU a GQA step's attention core is cuDNN's FP8 forward and backward custom calls; a step fills
    the site's history (every amax from the third step on) and the loss stays near bf16's."""
    _needs_cudnn_fp8()
    if not fp8.supported():
        pytest.skip("this GPU has no FP8 GEMMs")
    cfg = _gqa()
    graphdef, params = _split(cfg)
    histories = fp8_histories(cfg)
    tokens = jax.random.randint(jax.random.key(1), (4, 257), 0, cfg.vocab_size)
    step = jax.jit(make_train_step(graphdef, optax.sgd(0.0)))
    state = (params, optax.sgd(0.0).init(params))
    compiled = step.lower(*state, histories, tokens).compile()
    hlo = compiled.as_text()
    assert "__cudnn$fmhaSoftmaxF8" in hlo and "__cudnn$fmhaSoftmaxBackwardF8" in hlo
    # A fresh history's scales are 1: the first step's dO (about 5e-4) flushes to zero in e4m3, so its dS amax is
    # 0 and the second step's dS (scale 1 again) flushes too; from the third step every tensor has a scale.
    for _ in range(3):
        _, _, histories, metrics = compiled(*state, histories, tokens)
    newest = histories["blocks"]["attn"][SITE][:, :, 0]
    assert bool(metrics["finite"]) and bool((newest > 0).all()), newest
    bf16_graphdef, _ = _split(dataclasses.replace(cfg, matmul_dtype="compute"))
    want = float(jax.jit(lambda p: loss_fn(bf16_graphdef, p, tokens))(params))
    assert abs(float(metrics["loss"]) - want) < 0.02 * want
