"""`mlra eval ppl`: the official evaluation's windows, equal to training's own validation loss
and to a loss computed by hand; one row per set; bad files named."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import GPT2, ROOT, micro_experiment, records, subprocess_env
from xla_test_flags import SUBPROCESS

from mlra_jax.data.builtin import builtin_shards
from mlra_jax.data.pipeline import eval_windows
from mlra_jax.data.shards import find_shards, write_shard
from mlra_jax.eval import main as eval_main
from mlra_jax.generate import load_model
from mlra_jax.training.loop import train

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

SEQ, BATCH = 32, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    train(micro_experiment("mlra4_tiny", *GPT2, "--train.eval_every=6"), workdir, devices=jax.devices()[:1])
    return workdir


def test_ppl_equals_the_runs_own_validation_loss_on_the_same_windows(run, capsys):
    val = find_shards(builtin_shards(), "*_val_*.bin")[0]  # training validates on its first 2 batches of 8
    assert (
        eval_main(
            [
                "ppl",
                "--checkpoint",
                str(run),
                "--data",
                f"val={val}",
                "--data",
                f"again={val}",
                "--tokens",
                str(2 * BATCH * SEQ),
                "--seq_len",
                str(SEQ),
                "--batch_size",
                str(BATCH),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[:4]] == ["set", "val", "again", "average"]
    result = json.loads((run / "eval" / "ppl_step12.json").read_text())
    assert [s["name"] for s in result["sets"]] == ["val", "again"] and result["sets"][0]["windows"] == 2 * BATCH
    assert result["sets"][0]["loss"] == pytest.approx(records(run)[12]["val_loss"], abs=1e-5)
    assert result["sets"][0]["perplexity"] == pytest.approx(np.exp(result["sets"][0]["loss"]))


def test_ppl_defaults_to_the_runs_validation_split_at_its_seq_len(run, capsys):
    """No option but the run: its data's validation shards (here the built-in corpus's) at its train.seq_len;
    --data builtin names the same split."""
    tokens = ["--tokens", str(2 * BATCH * SEQ), "--batch_size", str(BATCH)]
    assert eval_main(["ppl", "--workdir", str(run), *tokens]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "val"
    result = json.loads((run / "eval" / "ppl_step12.json").read_text())
    assert result["seq_len"] == SEQ and result["sets"][0]["path"] == str(find_shards(builtin_shards(), "*_val_*")[0])
    assert result["sets"][0]["loss"] == pytest.approx(records(run)[12]["val_loss"], abs=1e-5)
    assert eval_main(["ppl", "--workdir", str(run), "--data", "builtin", *tokens]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "builtin"
    assert json.loads((run / "eval" / "ppl_step12.json").read_text())["sets"][0]["loss"] == result["sets"][0]["loss"]


def test_ppl_of_a_three_window_file_matches_a_hand_computed_loss(run, tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, size=3 * SEQ + 1)
    write_shard(tmp_path / "three.bin", tokens)
    windows = eval_windows(tmp_path / "three.bin", SEQ, tokens=10**6, batch_size=1)
    assert windows.shape == (3, SEQ + 1) and (windows[1] == tokens[SEQ : 2 * SEQ + 1]).all()

    model, _ = load_model(run)
    logits = np.asarray(model(windows[:, :-1]), dtype=np.float64)  # [3, SEQ, vocab]
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    by_hand = -np.take_along_axis(log_probs, windows[:, 1:, None], -1).mean()
    out = tmp_path / "result.json"
    assert (
        eval_main(
            [
                "ppl",
                "--checkpoint",
                str(run),
                "--data",
                f"three={tmp_path / 'three.bin'}",
                "--seq_len",
                str(SEQ),
                "--batch_size",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["sets"][0]["loss"] == pytest.approx(by_hand, abs=1e-5)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "missing.bin: cannot be read"),
        (b"not a shard at all" * 100, "magic number"),
        ("short", "fewer than one batch of 8 windows"),
    ],
)
def test_a_bad_eval_file_is_named(run, tmp_path, capsys, content, message):
    path = tmp_path / "missing.bin"
    if content == "short":
        write_shard(path, np.arange(100))
    elif content is not None:
        path.write_bytes(content)
    code = eval_main(
        [
            "ppl",
            "--checkpoint",
            str(run),
            "--data",
            f"x={path}",
            "--seq_len",
            str(SEQ),
            "--out",
            str(tmp_path / "r.json"),
            "--batch_size",
            str(BATCH),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and str(path) in err
    assert not (tmp_path / "r.json").exists()


def test_ppl_over_two_processes_equals_one(run, tmp_path):
    """launch/local.sh: 2 processes x 2 CPU devices, each reading its rows of every batch, give the loss of one
    process; only process 0 reports."""
    val = find_shards(builtin_shards(), "*_val_*.bin")[0]
    arguments = [
        "ppl",
        "--checkpoint",
        str(run),
        "--data",
        f"val={val}",
        "--tokens",
        str(2 * BATCH * SEQ),
        "--seq_len",
        str(SEQ),
        "--batch_size",
        str(BATCH),
    ]
    assert eval_main([*arguments, "--out", str(tmp_path / "one.json")]) == 0
    env = dict(subprocess_env(), DEVICES_PER_PROCESS="2", PYTHON=sys.executable, MODULE="mlra_jax.eval")
    env["XLA_FLAGS"] = SUBPROCESS  # launch/local.sh adds the device count
    result = subprocess.run(
        ["bash", "launch/local.sh", "2", *arguments, "--out", str(tmp_path / "two.json")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("results: ") == 1
    one, two = (json.loads((tmp_path / f"{n}.json").read_text())["sets"][0] for n in ("one", "two"))
    assert two["windows"] == one["windows"] == 2 * BATCH
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)


def test_held_out_sets_are_evaluated_during_training(tmp_path):
    val = find_shards(builtin_shards(), "*_val_*.bin")[0]  # the run's own validation file: the same windows
    experiment = micro_experiment("mlra4_tiny", *GPT2, "--train.total_steps=6", f"--train.eval_sets=held={val}")
    train(experiment, tmp_path, devices=jax.devices()[:1])
    logged = records(tmp_path)[6]
    assert logged["val/held/loss"] == pytest.approx(logged["val_loss"], abs=1e-6)
    assert logged["val/held/ppl"] == pytest.approx(np.exp(logged["val_loss"]), rel=1e-5)


def test_a_malformed_eval_sets_value_is_refused():
    from mlra_jax.config import ConfigError

    with pytest.raises(ConfigError, match="eval_sets item 'c4' is not NAME=PATH"):
        micro_experiment("mlra4_tiny", *GPT2, "--train.eval_sets=c4")
