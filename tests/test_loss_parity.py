"""mlra bench loss_parity: settings trained in processes of their own over seeds and repeats, their curves read back
and measured against the reference setting's mean and range."""

import json

import pytest
from helpers import MICRO
from xla_test_flags import IN_PROCESS

from mlra_jax.benchmarks import loss_parity


def _run(losses: dict[int, float], val: float | None = None) -> dict:
    return {"loss": losses, "val_loss": {} if val is None else {max(losses): val}}


def test_gaps_are_to_the_references_mean_and_beyond_its_range():
    curves = {
        "bf16": {1: [_run({10: 9.0, 100: 2.0, 200: 1.0}, 1.5), _run({10: 9.2, 100: 2.2, 200: 1.1}, 1.6)]},
        "fp8": {1: [_run({10: 9.9, 100: 2.1, 200: 1.21}, 1.7)]},
    }
    summary = loss_parity.summarize(curves, "bf16", after=50)
    (fp8,) = summary["fp8"]["1"]["runs"]
    assert fp8["first_line_loss"] == 9.9 and fp8["final_val_loss"] == 1.7
    assert fp8["at_step"] == 200 and fp8["worst_gap_to_reference_mean"] == pytest.approx(1.21 / 1.05 - 1, abs=1e-5)
    assert fp8["most_outside_reference_range"] == pytest.approx(0.1, abs=1e-5)  # 1.21 over the range's top, 1.1
    assert summary["bf16"]["1"]["final_val_loss_range"] == [1.5, 1.6]
    assert all(run["most_outside_reference_range"] == 0 for run in summary["bf16"]["1"]["runs"])
    assert loss_parity.summarize(curves, "bf16", after=500)["fp8"]["1"]["runs"][0]["at_step"] is None
    ax = loss_parity.figure(curves, "bf16").axes[0]
    (line,) = [line for line in ax.lines if line.get_label() == "fp8"]
    assert list(line.get_xdata()) == [10, 100, 200]
    assert list(line.get_ydata()) == pytest.approx([9.9 / 9.1 - 1, 2.1 / 2.1 - 1, 1.21 / 1.05 - 1])
    assert len(ax.collections) == 1  # the reference's range


@pytest.mark.parametrize("text", ["fp8", "=--model.matmul_dtype=float8", "a/b=", "--x="])
def test_a_setting_is_a_name_then_its_overrides(text):
    with pytest.raises(ValueError, match="NAME=OVERRIDES"):
        loss_parity.parse_setting(text)
    assert loss_parity.parse_setting("dyn=--model.matmul_dtype=float8 --model.fp8_scaling=dynamic") == (
        "dyn",
        ["--model.matmul_dtype=float8", "--model.fp8_scaling=dynamic"],
    )


def test_bad_settings_exit_2_before_any_run_starts(tmp_path, capsys):
    for settings, message in (
        (["--setting=a="], "at least two"),
        (["--setting=a=", "--setting=a=--train.seed=3"], "different names"),
        (["--setting=a=", "--setting=b=--model.no_such_field=1"], "setting 'b'"),
        (["--setting=a=", "--setting=b=", f"--figure={tmp_path / 'nowhere' / 'f.png'}"], "does not exist"),
    ):
        with pytest.raises(SystemExit) as exited:
            loss_parity.main(["--experiment=gqa_tiny", f"--workdir={tmp_path / 'runs'}", *settings])
        assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def one_device_children(monkeypatch):
    """The study's runs inherit this process's environment: each on one CPU device (not the suite's 8) and with
    the suite's cheapest compile, as their few steps need."""
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {IN_PROCESS}")


def _two_micro_runs(tmp_path, *overrides: str) -> list[str]:
    """Arguments of a study of two settings (f32, the reference, and bf16), seed 1, one run each, at once."""
    return [
        "--experiment=mlra4_tiny",
        f"--workdir={tmp_path / 'runs'}",
        "--seeds=1",
        "--repeats=1",
        "--parallel=2",
        *(f"--override={override}" for override in overrides),
        "--setting=f32=",
        "--setting=bf16=--model.compute_dtype=bfloat16",
        f"--out={tmp_path / 'parity.json'}",
    ]


def test_runs_train_in_processes_of_their_own_and_the_record_holds_their_curves(tmp_path, one_device_children):
    out = tmp_path / "parity.json"
    argv = _two_micro_runs(tmp_path, *MICRO, "--train.total_steps=3", "--train.eval_every=3")
    argv += ["--after=1", f"--figure={tmp_path / 'parity.png'}"]
    assert loss_parity.main(argv) == 0
    assert (tmp_path / "parity.png").read_bytes().startswith(b"\x89PNG")
    record = json.loads(out.read_text())
    assert record["reference"] == "f32" and record["settings"]["bf16"] == ["--model.compute_dtype=bfloat16"]
    reference, other = record["curves"]["f32"]["1"], record["curves"]["bf16"]["1"]
    assert len(reference) == len(other) == 1
    assert sorted(map(int, other[0]["loss"])) == [1, 2, 3] and list(other[0]["val_loss"]) == ["3"]
    (row,) = [r for r in record["results"] if r["setting"] == "bf16"]
    gaps = {s: other[0]["loss"][s] / reference[0]["loss"][s] - 1 for s in ("2", "3")}
    worst = max(gaps, key=lambda s: abs(gaps[s]))
    assert row["runs"][0]["worst_gap_to_reference_mean"] == pytest.approx(gaps[worst], abs=1e-5)
    assert (tmp_path / "runs" / "bf16" / "seed1_run0" / "train.log").read_text().count("finished at step 3") == 1


def test_runs_that_refuse_their_input_exit_2_naming_each_run_and_its_error(tmp_path, capsys, one_device_children):
    missing = tmp_path / "no_such_dataset"
    assert loss_parity.main(_two_micro_runs(tmp_path, f"--data.dataset={missing}")) == 2
    err = capsys.readouterr().err
    for setting in ("f32", "bf16"):
        assert f"{tmp_path / 'runs' / setting / 'seed1_run0'} (exit 2): " in err
    assert str(missing) in err and not (tmp_path / "parity.json").exists()
