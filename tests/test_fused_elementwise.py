"""Training's fused elementwise kernels (model.fused_elementwise): the residual add + RMSNorm and the SwiGLU
backward (pallas_kernels.add_rms_norm_gpu, swiglu_gpu) against their jnp references in Pallas interpret mode on
CPU (values and gradients, float32 and bf16), lowered for CUDA at the 2.9B models' widths, in the model (a tiny
model's loss and gradients with the option on equal those with it off, alone and under a data x fsdp x tensor
mesh; the remat policies recompute them), and compiled on a GPU."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import loss_and_grads, on_gpu
from jax._src.ad_checkpoint import saved_residuals
from mlra_jax.experiments.tiny import tiny_model
from mlra_jax.pallas_kernels import add_rms_norm_gpu as norms
from mlra_jax.pallas_kernels import swiglu_gpu
from mlra_jax.pallas_kernels.fp8_cast_gpu import Tiling

from mlra_jax import fused_elementwise
from mlra_jax.config import ConfigError, MeshConfig
from mlra_jax.model import REMAT_POLICIES, Block, default_positions
from mlra_jax.sharding import make_mesh

BF16, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-6


def assert_close(got, want, dtype):
    """Equal up to about one rounding of `dtype` of the largest value (the kernels sum in another order)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    ulp = 2.0**-7 if dtype == BF16 else 2e-6
    np.testing.assert_allclose(got, want, rtol=ulp, atol=2 * ulp * np.abs(want).max())


def norm_inputs(shape, branch_dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    d = shape[-1]
    x = 3 * jax.random.normal(keys[0], shape, F32)
    branch = None if branch_dtype is None else jax.random.normal(keys[1], shape, F32).astype(branch_dtype)
    scale = 1 + 0.1 * jax.random.normal(keys[2], (d,), F32)
    return x, branch, scale, keys[3:]


# (shape, branch dtype, normed rows' dtype, tiling): d = 48 in two column chunks (32 + 16) and 64 in one; bf16 and
# float32 branches; no branch (the norm alone); rows that block_rows does not divide (15); backward runs of
# several steps (programs=2)
NORM_CASES = [
    ((2, 5, 48), BF16, BF16, norms.Tiling()),
    ((2, 5, 48), F32, F32, norms.Tiling(block_rows=2, programs=2)),
    ((3, 5, 64), BF16, F32, norms.Tiling(block_rows=4, num_warps=8, programs=2)),
    ((4, 8, 48), None, BF16, norms.Tiling(block_rows=2, programs=3)),
]


@pytest.mark.parametrize(
    "shape,branch_dtype,out_dtype,tiling",
    NORM_CASES,
    ids=["bf16-branch-2-chunks", "f32-runs-of-2", "bf16-branch-f32-out-4-rows", "no-branch-ragged-programs"],
)
def test_add_rms_norm_in_interpret_mode_matches_the_reference(shape, branch_dtype, out_dtype, tiling):
    """Values and the gradients of x, the branch and the weight (jax.vjp), from cotangents of both outputs."""
    x, branch, scale, keys = norm_inputs(shape, branch_dtype, seed=shape[-1])

    def kernel(x, branch, scale):
        return norms.add_rms_norm(x, branch, scale, eps=EPS, out_dtype=out_dtype, tiling=tiling, interpret=True)

    def reference(x, branch, scale):
        return norms.add_rms_norm_reference(x, branch, scale, eps=EPS, out_dtype=out_dtype)

    got, got_vjp = jax.vjp(kernel, x, branch, scale)
    want, want_vjp = jax.vjp(reference, x, branch, scale)
    if branch is None:
        assert got[0] is None
    else:
        np.testing.assert_array_equal(got[0], want[0])  # the add: one rounding, the same
    assert got[1].dtype == want[1].dtype == out_dtype
    assert_close(got[1], want[1], out_dtype)
    d_stream = None if branch is None else jax.random.normal(keys[0], shape, F32)
    d_normed = jax.random.normal(keys[1], shape, F32).astype(out_dtype)
    for got_grad, want_grad in zip(got_vjp((d_stream, d_normed)), want_vjp((d_stream, d_normed))):
        if want_grad is None:
            assert got_grad is None
            continue
        assert got_grad.dtype == want_grad.dtype
        assert_close(got_grad, want_grad, BF16 if BF16 in (got_grad.dtype, out_dtype) else F32)


def test_the_forward_equals_the_models_norm_bit_for_bit_in_float32_on_one_chunk():
    """With the row in one power-of-two chunk (interpret mode sums it as XLA does) the float32 forward is the
    model's rms_norm after the add, bit for bit."""
    from mlra_jax.layers import rms_norm

    x, branch, scale, _ = norm_inputs((4, 8, 64), F32)
    stream, normed = norms.add_rms_norm(x, branch, scale, eps=EPS, interpret=True)
    np.testing.assert_array_equal(stream, x + branch)
    np.testing.assert_array_equal(normed, rms_norm(x + branch, scale, EPS))


def test_the_column_chunks_and_the_backward_runs():
    assert norms.column_chunks(3072) == ((0, 2048), (2048, 1024))
    assert norms.column_chunks(48) == ((0, 32), (32, 16)) and norms.column_chunks(64) == ((0, 64),)
    # 24,576 rows (batch 12 x 2048): 768 programs of 32 rows; rows no power of two divides: one row per step
    assert norms.backward_runs(24576, norms.Tiling()) == (1, 32)
    assert norms.backward_runs(24576, norms.Tiling(block_rows=4, programs=512)) == (4, 16)
    assert norms.backward_runs(15, norms.Tiling(block_rows=4, programs=2)) == (1, 1)
    assert swiglu_gpu.element_block(24576 * 9880, swiglu_gpu.Tiling()) == 2048
    assert swiglu_gpu.element_block(3 * 5 * 7, swiglu_gpu.Tiling()) == 1
    with pytest.raises(ValueError, match="power-of-two block_rows"):
        norms.Tiling(block_rows=3)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("forward_kernel", [False, True])
def test_swiglu_in_interpret_mode_matches_the_reference(dtype, forward_kernel):
    keys = jax.random.split(jax.random.key(1), 3)
    gate, up, d_out = (jax.random.normal(k, (2, 6, 40), F32).astype(dtype) for k in keys)
    tiling = swiglu_gpu.Tiling(block=64)  # 480 elements: blocks of 32
    got, got_vjp = jax.vjp(
        lambda g, u: swiglu_gpu.swiglu(g, u, forward_kernel=forward_kernel, tiling=tiling, interpret=True), gate, up
    )
    want, want_vjp = jax.vjp(swiglu_gpu.swiglu_reference, gate, up)
    assert got.dtype == dtype
    (np.testing.assert_array_equal if not forward_kernel else lambda a, b: assert_close(a, b, dtype))(got, want)
    for got_grad, want_grad in zip(got_vjp(d_out), want_vjp(d_out)):
        assert got_grad.dtype == dtype
        assert_close(got_grad, want_grad, dtype)


# The 2.9B models' widths: d = 3072 (2048 + 1024), GQA's SwiGLU 9728 and MLRA-4's 9880; two sequences of 2048
WIDE = dict(rows=(2, 2048), d=3072, ffn=(9728, 9880))


def test_the_kernels_lower_for_cuda_at_the_2p9b_widths():
    """The norm (forward and backward, bf16 branch and normed rows) and the SwiGLU backward lower to Triton calls
    for CUDA on this CPU (Triton compiles them on the GPU)."""
    spec = jax.ShapeDtypeStruct
    shape = (*WIDE["rows"], WIDE["d"])

    def norm_step(x, branch, scale):
        outs, vjp = jax.vjp(lambda *a: norms.add_rms_norm(*a, eps=EPS, out_dtype=BF16), x, branch, scale)
        return vjp(outs)

    args = (spec(shape, F32), spec(shape, BF16), spec(shape[-1:], F32))
    lowered = jax.jit(norm_step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("__gpu$xla.gpu.triton") == 2
    for f in WIDE["ffn"]:
        gate = spec((*WIDE["rows"], f), BF16)
        swiglu_step = jax.jit(lambda g, u: swiglu_gpu.swiglu_backward(g, u, u))
        assert "__gpu$xla.gpu.triton" in swiglu_step.trace(gate, gate).lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------- in the model
def tiny(**changes):
    return tiny_model(
        "gqa", **{"n_layer": 2, "n_head": 4, "n_embd": 64, "intermediate_size": 96, "vocab_size": 64, **changes}
    )


def assert_same_training(cfg, setting, rtol, mesh=None):
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 64)
    want_loss, want_grads = loss_and_grads(cfg, tokens)
    loss, grads = loss_and_grads(dataclasses.replace(cfg, fused_elementwise=setting), tokens, mesh)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=rtol / 10)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
        )


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels in interpret mode, standing in for an NVIDIA GPU's."""
    monkeypatch.setattr(fused_elementwise, "INTERPRET", True)


@pytest.mark.parametrize(
    "dtype,scan_layers,rtol",
    [
        pytest.param("float32", True, 2e-6, id="f32-scanned"),
        pytest.param("bfloat16", False, 2e-2, id="bf16-unrolled", marks=pytest.mark.slow),
    ],
)
def test_the_model_trains_the_same_with_the_kernels(interpreted, dtype, scan_layers, rtol):
    """fused_elementwise=on: the loss and every gradient of a 2-layer GQA model equal those of XLA's path (in
    bf16, up to the roundings the kernels skip and the normed rows' cotangent rounded once)."""
    assert_same_training(tiny(compute_dtype=dtype, scan_layers=scan_layers, output_init="normal"), "on", rtol=rtol)


@pytest.mark.slow
def test_mlra4_trains_the_same_with_the_kernels(interpreted):
    """The latent family's attention reads the normed rows in the compute dtype as GQA's does: MLRA-4's float32 loss
    and gradients with the kernels equal XLA's path's."""
    cfg = tiny_model("mlra4", n_layer=2, n_head=8, n_embd=64, intermediate_size=96, vocab_size=64)
    assert_same_training(dataclasses.replace(cfg, output_init="normal"), "on", rtol=2e-6)


def test_the_kernels_under_a_data_fsdp_tensor_mesh(interpreted):
    """On a (data 2, fsdp 2, tensor 2) mesh of 8 CPU devices each kernel runs on its device's sequences (the
    SwiGLU's columns split over tensor; unrolled layers: the first norm without a branch): the float32 loss and
    gradients equal the unsharded XLA path's."""
    if jax.device_count() < 8 or jax.default_backend() != "cpu":
        pytest.skip("runs on the 8 virtual CPU devices of the test suite")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])
    assert_same_training(tiny(output_init="normal", scan_layers=False), "on", rtol=2e-6, mesh=mesh)


def test_the_setting_takes_the_kernels_on_gpus_only(interpreted, monkeypatch, caplog):
    assert fused_elementwise.kernels("on") == {"norms", "swiglu"}
    assert fused_elementwise.kernels("swiglu") == {"swiglu"} and fused_elementwise.kernels("off") == set()
    assert fused_elementwise.kernels("auto") == fused_elementwise.AUTO_KERNELS == {"norms", "swiglu"}  # H100 A/B
    assert tiny().fused_elementwise == "auto"  # the default
    monkeypatch.setattr(fused_elementwise, "INTERPRET", False)  # this CPU as it is
    fused_elementwise.log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="mlra_jax.fused_elementwise"):
        assert fused_elementwise.kernels("on") == set() and fused_elementwise.kernels("on") == set()
        monkeypatch.setattr(fused_elementwise, "AUTO_KERNELS", frozenset({"norms"}))
        assert fused_elementwise.kernels("auto") == set()
    assert [r.getMessage() for r in caplog.records] == [
        "fused_elementwise='on': the elementwise passes run on XLA (the fused elementwise kernels run on NVIDIA "
        "GPUs; the backend is 'cpu')"
    ]
    with pytest.raises(ConfigError, match="fused_elementwise='fused' is not valid"):
        tiny(fused_elementwise="fused")


@pytest.mark.parametrize("remat", ["dots_attn", "dots"])
def test_remat_policies_recompute_the_kernels(interpreted, remat):
    """dots_attn keeps the attention kernels' outputs (pallas_call among them) but not these kernels': a block
    saves the same bytes for its backward with the option on as off."""
    saved = {}
    for setting in ("off", "on"):
        cfg = tiny(compute_dtype="bfloat16", fused_elementwise=setting)
        graphdef, state = nnx.split(Block(cfg, rngs=nnx.Rngs(0)))
        positions = default_positions(jnp.zeros((2, 16), jnp.int32))
        x, pending = jnp.zeros((2, 16, 64), F32), jnp.zeros((2, 16, 64), BF16)

        def layer(p, x, pending, setting=setting):
            block = nnx.merge(graphdef, p)
            return (
                block(x + pending, positions) if setting == "off" else block.fused((x, pending), positions, None, BF16)
            )

        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
        residuals = saved_residuals(layer, nnx.to_pure_dict(state), x, pending)
        saved[setting] = sum(a.size * a.dtype.itemsize for a, source in residuals if "argument" not in source)
    assert saved["on"] == saved["off"]


@pytest.mark.slow  # compiles two train steps
def test_the_interleaved_benchmark_compares_the_option_off_and_on(tmp_path, interpreted, monkeypatch):
    """`mlra bench interleaved --a=--model.fused_elementwise=off --b=--model.fused_elementwise=on`: both train steps
    compile and run on one state, the second on the kernels (traced: 2 norms per layer and the final one)."""
    import json

    from mlra_jax.experiments import registry

    from mlra_jax.benchmarks import interleaved

    experiment = registry.get_experiment("gqa_tiny")
    small = dataclasses.replace(experiment, model=dataclasses.replace(experiment.model, vocab_size=128))
    monkeypatch.setitem(registry._EXPERIMENTS, "gqa_tiny", small)
    traced = []
    forward = fused_elementwise._norm_forward
    monkeypatch.setattr(fused_elementwise, "_norm_forward", lambda *a: traced.append(1) or forward(*a))
    out = tmp_path / "ab.json"
    interleaved.main(
        ["--experiment=gqa_tiny", "--n_layer=1", "--seq_len=16", "--batch_per_device=1", "--pairs=1", "--warmup=0"]
        + ["--a=--model.fused_elementwise=off", "--b=--model.fused_elementwise=on", f"--out={out}"]
    )
    (result,) = json.loads(out.read_text())["results"]
    assert result["overrides"]["b"] == ["--model.fused_elementwise=on"] and result["b_over_a"] > 0
    assert len(traced) >= 3


def test_the_elementwise_benchmark_times_the_same_passes_and_refuses_a_cpu(tmp_path, capsys, monkeypatch):
    """`mlra bench elementwise`: each kernel pass (here in interpret mode, one tiling each) computes what XLA's does;
    the kernels run on GPUs only, so the benchmark exits 2 here with the reason."""
    from mlra_jax.benchmarks import elementwise

    monkeypatch.setattr(elementwise, "NORM_TILINGS", (norms.Tiling(block_rows=2, programs=2),))
    monkeypatch.setattr(elementwise, "SWIGLU_TILINGS", (swiglu_gpu.Tiling(block=64),))
    monkeypatch.setattr(elementwise, "CAST_TILINGS", (Tiling(16, 32, 2),))
    outputs = {}
    for item in elementwise.passes(rows=12, d=48, f=40, interpret=True):
        outputs.setdefault(item.name, {})[item.path] = jax.jit(item.fn)(*item.args)
        assert item.floor_bytes(12) == elementwise.FLOOR_BYTES_PER_ELEMENT[item.name] * item.elements * 12
    assert set(outputs) == {"norm_fwd", "norm_bwd", "swiglu_fwd", "swiglu_bwd", "fp8_cast_d", "fp8_cast_f"}
    for name, paths in outputs.items():
        for got, want in zip(jax.tree.leaves(paths["kernel"]), jax.tree.leaves(paths["xla"])):
            if name.startswith("fp8_cast"):  # bit for bit
                np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)))
            else:
                assert_close(got, want, BF16 if BF16 in (got.dtype, want.dtype) or "swiglu" in name else F32)
    with pytest.raises(SystemExit) as exit_info:
        elementwise.main([f"--out={tmp_path / 'x.json'}"])
    assert exit_info.value.code == 2 and "run on NVIDIA GPUs" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


# ----------------------------------------------------------------------------- on a GPU
@on_gpu
@pytest.mark.parametrize("branch_dtype,out_dtype", [(BF16, BF16), (F32, F32)])
def test_the_compiled_norm_at_the_2p9b_width(branch_dtype, out_dtype):
    shape = (*WIDE["rows"], WIDE["d"])
    x, branch, scale, keys = norm_inputs(shape, branch_dtype)
    got, got_vjp = jax.vjp(lambda *a: norms.add_rms_norm(*a, eps=EPS, out_dtype=out_dtype), x, branch, scale)
    want, want_vjp = jax.vjp(
        lambda *a: norms.add_rms_norm_reference(*a, eps=EPS, out_dtype=out_dtype), x, branch, scale
    )
    assert_close(got[0], want[0], F32)
    assert_close(got[1], want[1], out_dtype)
    cotangents = (jax.random.normal(keys[0], shape, F32), jax.random.normal(keys[1], shape, F32).astype(out_dtype))
    for got_grad, want_grad in zip(got_vjp(cotangents), want_vjp(cotangents)):
        assert_close(got_grad, want_grad, BF16 if BF16 in (got_grad.dtype, out_dtype) else F32)


@on_gpu
@pytest.mark.parametrize("f", WIDE["ffn"])
def test_the_compiled_swiglu_at_the_2p9b_widths(f):
    keys = jax.random.split(jax.random.key(2), 3)
    gate, up, d_out = (jax.random.normal(k, (*WIDE["rows"], f), BF16) for k in keys)
    got = swiglu_gpu.swiglu_backward(gate, up, d_out)
    want = jax.vjp(swiglu_gpu.swiglu_reference, gate, up)[1](d_out)
    for g, w in zip(got, want):
        assert_close(g, w, BF16)
    assert_close(swiglu_gpu.swiglu_forward(gate, up), swiglu_gpu.swiglu_reference(gate, up), BF16)


@on_gpu
def test_a_bf16_model_on_the_compiled_kernels_trains_as_xla_does():
    cfg = tiny(n_embd=256, intermediate_size=768, head_dim=64, compute_dtype="bfloat16", output_init="normal")
    assert_same_training(cfg, "on", rtol=2e-2)
