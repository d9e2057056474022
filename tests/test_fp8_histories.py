"""FP8 delayed scaling in training (model.fp8_scaling=delayed) on the CPU, with FP8 GEMMs pretended available: the
train step records each projection's amaxes in its history, micro-batches merge theirs, and the histories live in
the train state: saved, restored bit for bit on resume, and started fresh when a run changes to float8."""

import dataclasses
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import SMALL_VOCAB, micro_experiment, on_gpu
from mlra_jax.experiments import get_experiment

from mlra_jax import fp8
from mlra_jax.benchmarks.train import gemm_calls
from mlra_jax.checkpoint import Checkpointer
from mlra_jax.model import fp8_histories, init_model
from mlra_jax.training.loop import TrainingLoop, train
from mlra_jax.training.state import build_setup
from mlra_jax.training.step import make_train_step

ONE_DEVICE = jax.devices()[:1]
FLOAT8 = ("--model.compute_dtype=bfloat16", "--model.matmul_dtype=float8")


@pytest.fixture
def fp8_gemms(monkeypatch):
    monkeypatch.setattr(fp8, "supported", lambda device=None: True)
    monkeypatch.setattr(fp8, "HISTORY", 4)  # longer than the default's one step: the rolling shows


def _tiny():
    cfg = dataclasses.replace(
        get_experiment("mlra4_tiny").model,
        n_layer=2,
        compute_dtype="bfloat16",
        matmul_dtype="float8",
        output_init="normal",
        vocab_size=SMALL_VOCAB,  # the histories are the layers' projections'; GPT-2's output layer was most of the work
    )
    graphdef, state = nnx.split(init_model(cfg, seed=0))
    return cfg, graphdef, nnx.to_pure_dict(state)


def test_a_delayed_step_records_every_projections_amaxes_newest_first(fp8_gemms):
    cfg, graphdef, params = _tiny()
    histories = fp8_histories(cfg)
    assert set(histories["blocks"]["attn"]) == {"q_down", "q_up", "kv_down", "k_rope_proj", "o_proj"}
    step = jax.jit(make_train_step(graphdef, optax.sgd(0.0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    assert "f8E4M3FN" in step.lower(params, optax.sgd(0.0).init(params), histories, tokens).as_text()
    _, _, first, metrics = step(params, optax.sgd(0.0).init(params), histories, tokens)
    _, _, second, _ = step(params, optax.sgd(0.0).init(params), first, tokens)
    assert bool(metrics["finite"])
    for h1, h2 in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert h1.shape == (2, 3, fp8.HISTORY) and bool((h1[:, :, 0] > 0).all()) and not h1[:, :, 1:].any()
        np.testing.assert_array_equal(h2[:, :, 1], h1[:, :, 0])  # rolled: last step's amax one place older
    weight = params["blocks"]["mlp"]["gate_proj"].astype(jnp.bfloat16)  # row 1: the weight's amax, per layer
    np.testing.assert_array_equal(first["blocks"]["mlp"]["gate_proj"][:, 1, 0], jnp.abs(weight).max(axis=(1, 2)))


def test_micro_batches_merge_their_amaxes(fp8_gemms):
    cfg, graphdef, params = _tiny()
    tokens = jax.random.randint(jax.random.key(2), (4, 17), 0, cfg.vocab_size)
    state = (params, optax.sgd(0.0).init(params), fp8_histories(cfg))
    split = jax.jit(make_train_step(graphdef, optax.sgd(0.0), accumulation_steps=2))(*state, tokens)[2]
    whole = jax.jit(make_train_step(graphdef, optax.sgd(0.0)))
    parts = [whole(*state, tokens[i::2])[2] for i in range(2)]  # micro-batch i: rows i, i + 2 (micro_batches)
    for got, a, b in zip(jax.tree.leaves(split), *map(jax.tree.leaves, parts)):
        np.testing.assert_array_equal(got, jnp.maximum(a, b))


def _saved_state(workdir, experiment):
    setup = build_setup(experiment, ONE_DEVICE)
    checkpointer = Checkpointer(workdir / "checkpoints", experiment.checkpoint, read_only=True)
    try:
        return checkpointer.restore_latest(setup.abstract_state)
    finally:
        checkpointer.close()


@pytest.mark.slow
def test_histories_resume_bit_for_bit_and_start_fresh_after_a_change_to_float8(tmp_path, fp8_gemms, caplog):
    steps = ("--train.eval_every=0", "--checkpoint.every=2")
    whole = micro_experiment("mlra4_tiny", *FLOAT8, *steps, "--train.total_steps=6")
    train(whole, tmp_path / "whole", devices=ONE_DEVICE)
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")  # as if killed before step 6 was saved
    train(whole, tmp_path / "resumed", devices=ONE_DEVICE)
    (step, want, _), (resumed_step, got, _) = (
        _saved_state(tmp_path / "whole", whole),
        _saved_state(tmp_path / "resumed", whole),
    )
    assert step == resumed_step == 6 and jax.tree.leaves(got["fp8"])
    assert bool(jax.tree.leaves(got["fp8"])[0][:, 0, :4].all())  # the last four steps' activation amaxes
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)

    bf16 = micro_experiment(
        "mlra4_tiny", "--model.compute_dtype=bfloat16", *steps, "--train.total_steps=4", "--train.warmup_steps=1"
    )
    train(bf16, tmp_path / "changed", devices=ONE_DEVICE)
    assert "fp8" not in _saved_state(tmp_path / "changed", bf16)[1]  # none kept without float8
    shutil.rmtree(tmp_path / "changed" / "checkpoints" / "4")  # resume from step 2, now in float8
    more = micro_experiment("mlra4_tiny", *FLOAT8, *steps, "--train.total_steps=4", "--train.warmup_steps=1")
    with caplog.at_level("INFO"):
        train(more, tmp_path / "changed", devices=ONE_DEVICE)
    assert "step 2 starts fresh FP8 scales" in caplog.text
    histories = jax.tree.leaves(_saved_state(tmp_path / "changed", more)[1]["fp8"])
    assert histories and bool(histories[0][:, 0, :2].all()) and not histories[0][:, :, 2:].any()


def fp8_dots(hlo: str) -> int:
    """The dots of an HLO module whose operands are all FP8 (each computation's names resolved to their types)."""
    count = 0
    for computation in hlo.split("\n\n"):
        types = dict(re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = \(?(\w+)\[", computation, re.M))
        for operands in re.findall(r" dot\(([^)]*)\)", computation):
            names = [operand.strip().split()[-1].lstrip("%") for operand in operands.split(",")]
            count += all(types.get(name, "").startswith("f8") for name in names)
    return count


def test_the_step_multiplies_fp8_operands_in_each_projection(fp8_gemms):
    """Before XLA's optimizations (CPUs upcast FP8 dots after): each projection's forward and two backward dots."""
    cfg, graphdef, params = _tiny()
    histories = fp8_histories(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    step = jax.jit(make_train_step(graphdef, optax.sgd(0.0)))
    hlo = step.lower(params, optax.sgd(0.0).init(params), histories, tokens).as_text("hlo")
    assert fp8_dots(hlo) == 3 * len(jax.tree.leaves(histories))  # the scanned layer's dots appear once


@on_gpu
def test_the_compiled_gpu_step_runs_its_projections_as_fp8_gemms():
    """On a GPU with FP8 tensor cores the step's projections are cuBLASLt FP8 GEMMs, and a step fills the histories."""
    if not fp8.supported():
        pytest.skip("this GPU has no FP8 GEMMs")
    cfg, graphdef, params = _tiny()
    histories = fp8_histories(cfg)
    step = jax.jit(make_train_step(graphdef, optax.sgd(0.0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 129), 0, cfg.vocab_size)
    # XLA's dot merger (off here) would join the GEMMs that share an FP8 operand (the projections of one input and
    # their weight gradients) into one each, as the trainer's steps run them
    options = {"xla_gpu_dot_merger_threshold_mb": 0}
    compiled = step.lower(params, optax.sgd(0.0).init(params), histories, tokens).compile(options)
    hlo = compiled.as_text()
    # FP8 GEMMs as cuBLASLt calls, or (small ones, Triton GEMM fusions on) dots of FP8 operands in XLA's fusions
    fp8_gemms = gemm_calls(hlo)["fp8"] + fp8_dots(hlo)
    projections = len(jax.tree.leaves(histories))  # per layer (a scanned layer's GEMMs appear once)
    assert fp8_gemms >= 3 * projections, (fp8_gemms, gemm_calls(hlo))  # each: a forward and two backward GEMMs
    updated = compiled(params, optax.sgd(0.0).init(params), histories, tokens)[2]
    assert all(bool((h[:, :2, 0] > 0).all()) for h in jax.tree.leaves(updated))


def test_info_and_dry_run_describe_the_histories(capsys):
    from mlra_jax.info import describe, format_description
    from mlra_jax.train import main as train_main

    experiment = micro_experiment("mlra4_tiny", *FLOAT8)
    info = describe(experiment)
    assert info["fp8"].startswith(
        f"FP8 amax histories: 8 projections x 1 layers x 3 tensors (x, w, gradient) x {fp8.HISTORY}"
    )
    assert info["fp8"] in format_description(info, experiment.model)
    assert describe(micro_experiment("mlra4_tiny"))["fp8"] is None
    assert train_main(["--experiment=mlra4_tiny", *FLOAT8, "--dry_run"]) == 0
    assert "FP8 amax histories: 8 projections x 4 layers" in capsys.readouterr().out


def _saved_run(workdir, experiment, steps_and_histories):
    """A run whose checkpoints (step -> FP8 histories, None: the fresh ones) are saved directly: no training."""
    from mlra_jax.training.resume_check import record_experiment
    from mlra_jax.training.state import init_state

    fresh = init_state(build_setup(experiment, ONE_DEVICE))
    checkpointer = Checkpointer(workdir / "checkpoints", experiment.checkpoint)
    for step, histories in steps_and_histories.items():
        state = dict(fresh)
        state["fp8"] = state["fp8"] if histories is None else histories(state["fp8"])
        metadata = {"step": step, "examples": step * experiment.train.global_batch_size, "experiment": "x"}
        checkpointer.save(step, state, metadata)
    checkpointer.close()
    record_experiment(workdir, experiment)


RESUME = ("--train.eval_every=0", "--checkpoint.every=100", "--train.warmup_steps=1")


@pytest.mark.slow
def test_a_delayed_run_resumes_with_fp8_off_or_dynamic(tmp_path, caplog):
    delayed = micro_experiment("mlra4_tiny", *FLOAT8, *RESUME, "--train.total_steps=2")
    _saved_run(tmp_path, delayed, {2: None})
    for changed in ("--model.matmul_dtype=compute", "--model.fp8_scaling=dynamic"):
        caplog.clear()
        resumed = micro_experiment("mlra4_tiny", *FLOAT8, *RESUME, changed, "--train.total_steps=3")
        with caplog.at_level("INFO"):
            assert train(resumed, tmp_path, devices=ONE_DEVICE, allow_changed=("train.total_steps",)).step == 3
        assert "resumed from" in caplog.text and "holds fp8 of another layout" in caplog.text
        shutil.rmtree(tmp_path / "checkpoints" / "3")  # the next change resumes from the delayed step 2 again
    assert not list((tmp_path / "checkpoints").glob("*.damaged*"))


@pytest.mark.slow
def test_histories_of_another_length_or_damaged_ones_start_fresh(tmp_path, caplog, monkeypatch):
    """Step 4 saved by a version that kept 16 steps of history (and one projection fewer): a valid checkpoint,
    restored without them; step 6's histories hold NaN, inf, negative and huge amaxes: those are reset."""
    experiment = micro_experiment("mlra4_tiny", *FLOAT8, *RESUME, "--train.total_steps=5")
    with monkeypatch.context() as old:
        old.setattr(fp8, "HISTORY", 16)
        _saved_run(tmp_path, experiment, {2: None, 4: lambda h: {"blocks": {"mlp": h["blocks"]["mlp"]}}})
    with caplog.at_level("INFO"):
        assert train(experiment, tmp_path, devices=ONE_DEVICE).step == 5
    assert "resumed from" in caplog.text and "at step 4" in caplog.text and "step 4 starts fresh FP8" in caplog.text
    assert not list((tmp_path / "checkpoints").glob("*.damaged*"))

    values = iter([float("nan"), float("inf"), -1.0, 1e30])
    damage = lambda h: jax.tree.map(lambda a: a.at[0, 0, 0].set(next(values, 0.0)), h)
    _saved_run(tmp_path, experiment, {6: damage})
    setup = build_setup(experiment, ONE_DEVICE)
    caplog.clear()
    with caplog.at_level("INFO"), jax.set_mesh(setup.mesh):
        loop = TrainingLoop(setup, tmp_path)  # restores step 6 (nothing is compiled or trained)
        loop.checkpointer.close()
        loop.writer.close()
    assert loop.step == 6 and "in checkpoint 6 hold NaN, inf, negative or huge values" in caplog.text
    assert caplog.text.count("blocks.") >= 4
    histories = jax.tree.leaves(loop.state["fp8"])
    assert all(bool(jnp.isfinite(h).all() and (h >= 0).all() and (h < 1e19).all()) for h in histories)
