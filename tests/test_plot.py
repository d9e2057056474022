"""mlra plot: the curves of runs' metrics.jsonl into a PNG; bad input exits 2 naming the file."""

import json

import pytest

from mlra_jax.plot import main as plot_main
from mlra_jax.plot import plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(folder, losses, held_out=False):
    """A run folder whose metrics.jsonl logs `losses` (a validation loss every 2 steps), as training writes it."""
    folder.mkdir()
    lines = []
    for step, loss in enumerate(losses, 1):
        record = {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0 + step, "mfu": None}
        if step % 2 == 0:
            record["val_loss"] = loss + 0.1
            if held_out:
                record["val/c4/loss"], record["val/c4/ppl"] = loss + 0.2, 2.0
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot")
    return [
        write_run(root / "mla_tiny", [10.9, 9.0, 7.5, 6.8]),
        write_run(root / "mlra4_tiny", [10.9, 8.8, 7.2, 6.5], held_out=True),
    ]


def test_two_runs_give_one_png_with_a_curve_per_run_and_panel(tmp_path, two_runs, capsys):
    out = tmp_path / "compare.png"
    assert plot_main([str(run) for run in two_runs] + [f"--out={out}"]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {out} (2 runs)" in capsys.readouterr().out
    fig = plot_runs(two_runs)
    loss, held_out, throughput = fig.axes
    assert [line.get_label() for line in loss.lines] == [
        "mla_tiny train",
        "mla_tiny validation",
        "mlra4_tiny train",
        "mlra4_tiny validation",
    ]
    assert list(loss.lines[3].get_xdata()) == [2, 4] and list(loss.lines[3].get_ydata()) == pytest.approx([8.9, 6.6])
    assert "val/c4/loss" in held_out.get_title() and [line.get_label() for line in held_out.lines] == ["mlra4_tiny"]
    assert len(throughput.lines) == 2
    assert all(not (run / "curves.png").exists() for run in two_runs)  # the runs are only read


def test_a_torn_last_line_is_skipped(tmp_path, two_runs):
    run = write_run(tmp_path / "killed", [10.0, 9.0])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 8.')  # a kill mid-write
    assert [len(line.get_xdata()) for line in plot_runs([run]).axes[0].lines] == [2, 1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda run: run.mkdir(), "metrics.jsonl does not exist: give a run directory"),
        (lambda run: (run.mkdir(), (run / "metrics.jsonl").write_text("")), "metrics.jsonl holds no metrics records"),
        (lambda run: (run.mkdir(), (run / "metrics.jsonl").write_text("not json\n")), "holds no metrics records"),
    ],
)
def test_bad_input_exits_2_naming_the_file_and_writes_nothing(tmp_path, two_runs, capsys, monkeypatch, make, message):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad_run"
    make(bad)
    assert plot_main([str(two_runs[0]), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"error: {bad / 'metrics.jsonl'}" in err and message in err
    assert not (tmp_path / "curves.png").exists()


def test_an_output_folder_that_does_not_exist_is_named(tmp_path, two_runs, capsys):
    assert plot_main([str(two_runs[0]), f"--out={tmp_path / 'missing' / 'x.png'}"]) == 2
    assert f"the folder {tmp_path / 'missing'} does not exist" in capsys.readouterr().err


def test_the_image_goes_into_the_first_runs_folder_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = write_run(tmp_path / "mine", [10.9, 9.0])
    assert plot_main([str(run)]) == 0
    assert (run / "curves.png").read_bytes().startswith(PNG_MAGIC) and not (tmp_path / "curves.png").exists()
    assert f"wrote {run / 'curves.png'}" in capsys.readouterr().out
