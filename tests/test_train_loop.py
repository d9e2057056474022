"""The training loop in-process: every family trains; NaN, damaged checkpoints, dry run, CLI errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_VOCAB, losses, micro_experiment

from mlra_jax.checkpoint import Checkpointer
from mlra_jax.train import main as train_main
from mlra_jax.training import state as training_state
from mlra_jax.training.loop import TrainingDiverged, train

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

ONE_DEVICE = jax.devices()[:1]  # the loop's logic; meshes of several devices are tested in test_resume


@pytest.mark.parametrize("name", ["gqa_tiny", "mlra4_tiny", "mfa_tiny", "tpa_tiny", "gta_tiny"])
def test_each_family_trains_on_the_builtin_corpus(tmp_path, name):
    evaluate = name == "mlra4_tiny"  # one family also runs validation
    experiment = micro_experiment(name, "--train.total_steps=20", f"--train.eval_every={10 if evaluate else 0}")
    result = train(experiment, tmp_path, devices=ONE_DEVICE)
    logged = losses(tmp_path)
    assert result.step == 20 and sorted(logged) == list(range(1, 21))
    first, last = np.mean([logged[s] for s in range(1, 5)]), np.mean([logged[s] for s in range(17, 21)])
    # from about the uniform loss, log(512) = 6.24 (the built-in corpus's token ids modulo 512), down by 0.8-0.9
    assert first > np.log(SMALL_VOCAB) - 0.5 and last < first - 0.5, (first, last)
    assert Checkpointer(tmp_path / "checkpoints", experiment.checkpoint).steps() == [12, 16, 20]  # the last 3 kept
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    if evaluate:
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "val_loss" in r] == [10, 20]


def _poison(monkeypatch, from_step):
    """Make the train step return NaN parameters and loss from optimizer step `from_step` on."""
    real = training_state.make_train_step

    def poisoned(*args, **kwargs):
        step = real(*args, **kwargs)

        def bad(params, opt_state, histories, tokens):
            params, opt_state, histories, metrics = step(params, opt_state, histories, tokens)
            count = jax.tree.leaves(opt_state)[0]  # the Adam step counter
            nan = jnp.where(count >= from_step, jnp.nan, 1.0)
            poisoned_params = jax.tree.map(lambda p: p * nan, params)
            return poisoned_params, opt_state, histories, dict(metrics, loss=metrics["loss"] * nan)

        return bad

    monkeypatch.setattr(training_state, "make_train_step", poisoned)


def test_nan_loss_stops_and_never_overwrites_the_last_good_checkpoint(tmp_path, monkeypatch):
    experiment = micro_experiment("mlra4_tiny", "--train.eval_every=0", "--train.log_every=100")
    _poison(monkeypatch, from_step=6)  # steps 6.. are NaN; the first check is at the save of step 8
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 6.*last good checkpoint is .*checkpoints/4"):
        train(experiment, tmp_path, devices=ONE_DEVICE)
    checkpointer = Checkpointer(tmp_path / "checkpoints", experiment.checkpoint)
    assert checkpointer.steps() == [4]
    monkeypatch.undo()
    result = train(experiment, tmp_path, devices=ONE_DEVICE)  # the good checkpoint resumes
    assert result.step == 12 and np.isfinite(result.last_loss)


def test_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog):
    experiment = micro_experiment("mlra4_tiny", "--train.total_steps=8", "--train.eval_every=0")
    train(experiment, tmp_path, devices=ONE_DEVICE)
    first = losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "8" / "state")  # step 8 loses its arrays
    (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-1234").mkdir()  # an interrupted save
    with caplog.at_level("WARNING"):
        result = train(experiment, tmp_path, devices=ONE_DEVICE)
    assert "checkpoints/8 is incomplete or damaged" in caplog.text
    assert (tmp_path / "checkpoints" / "8.damaged" / "metadata").is_dir()  # set aside, not deleted
    assert result.step == 8
    again = losses(tmp_path)
    assert [again[s] for s in range(5, 9)] == [first[s] for s in range(5, 9)]  # recomputed from step 4, exactly


def test_dry_run_of_the_paper_model(capsys):
    assert train_main(["--experiment=mlra4_2p9b", "--dry_run", "--data.dataset=builtin"]) == 0
    out = capsys.readouterr().out
    assert '"variant": "mlra4"' in out and "parameters: 2,873,220,096" in out and "training: 1 shard(s)" in out
    assert f"mesh: {{'data': 1, 'fsdp': {jax.device_count()}, 'tensor': 1}}" in out
    params_gib = 2873220096 * 4 / jax.device_count() / 2**30
    assert f"params {params_gib:.2f} GiB, optimizer_state {2 * params_gib:.2f} GiB" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model.n_layers=3"],
            "unknown option --model.n_layers=3 (did you mean --model.n_layer?)",
        ),
        (["--train.peak_lr=fast"], "--train.peak_lr='fast' is not a valid float"),
        (["--model.kv_lora_rank=62"], "kv_lora_rank=62 is not divisible by the 4 latent blocks"),
        (["--optimizer.lr=1"], "unknown option --optimizer.lr"),
        (["--data.dataset=/nonexistent/shards"], "data directory /nonexistent/shards does not exist; create it with"),
        (["--train.global_batch_size=6"], "must split evenly over the 8 data-parallel devices"),
    ],
)
def test_cli_errors_name_the_problem(tmp_path, capsys, args, message):
    assert train_main(["--experiment=mlra4_tiny", f"--workdir={tmp_path}", *args]) == 2
    assert message in capsys.readouterr().err


def test_help_lists_experiments_and_fields(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "mlra4_2p9b" in out and "gqa_tiny" in out and "--train.peak_lr float" in out
    for allowed in (
        "--model.remat {none,full,dots,dots_attn,dots_attn_kv,dots_attn_qkv,auto}",
        "--model.compute_dtype {float32,bfloat16,float16}",
        "--model.attention_impl {auto,xla,cudnn,splash,pallas,mlra_kernel}",
        "--model.output_init {zero,normal}",
        "--model.scan_layers {true,false}",
        "--model.variant {mha,mqa,gqa,mla,mfa,tpa,gla2,gla4,gta,",
        "--train.micro_batch_size int|none",
        "--metrics.wandb_project str|none",
        "--profile.steps int",
    ):
        assert allowed in out, allowed
