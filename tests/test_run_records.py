"""A run's own records survive whatever stops a command: experiment.json and metrics.jsonl are replaced whole or
not at all, a resume that fails leaves experiment.json as it was, and a run directory that cannot be used is
refused (exit 2, one message) before anything is written."""

import json
import subprocess
import sys
import tempfile

import jax
import pytest
from helpers import MICRO, ROOT, micro_experiment, run_training, subprocess_env
from test_run_safety import listing

from mlra_jax import guards
from mlra_jax.train import main as train_main
from mlra_jax.training.loop import train

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

# One process imports the writer once, then forks a child per kill that rewrites the file over and over; the parent
# SIGKILLs it at a random moment and prints what the file held.
KILLER = """
import os, random, signal, sys, time
from mlra_jax.guards import atomic_write_text

path, size, kills = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
for _ in range(kills):
    child = os.fork()
    if child == 0:
        for i in range(10**6):
            atomic_write_text(path, str(i % 10) * size)
        os._exit(0)
    time.sleep(rng.uniform(0.0, 0.3))
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    content = open(path).read()
    print(len(content), len(set(content)), flush=True)
    for name in os.listdir(os.path.dirname(path)):
        if name.startswith(".metrics.jsonl.") and name.endswith(".tmp"):
            os.unlink(os.path.join(os.path.dirname(path), name))
"""


def test_a_kill_at_any_moment_of_a_rewrite_leaves_a_whole_file(tmp_path):
    """A process rewriting a 4 MB file over and over, killed at random moments ten times: the file always holds
    one whole version, and no temporary file is left behind but the one being written at the kill."""
    target, size = tmp_path / "metrics.jsonl", 4 << 20
    target.write_text("x" * size)
    done = subprocess.run(
        [sys.executable, "-c", KILLER, str(target), str(size), "10"],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [tuple(map(int, line.split())) for line in done.stdout.splitlines()]
    assert seen == [(size, 1)] * 10, "a torn file"


def test_an_interrupted_rewrite_keeps_the_old_content_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "experiment.json"
    target.write_text("old")
    monkeypatch.setattr(guards.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        guards.atomic_write_text(target, "new")
    assert target.read_text() == "old" and listing(tmp_path) == ["experiment.json"]


def trained(tmp_path, steps=8):
    train(
        micro_experiment("mlra4_tiny", f"--train.total_steps={steps}", "--train.eval_every=0"),
        tmp_path,
        devices=jax.devices()[:1],
    )
    return (tmp_path / "experiment.json").read_bytes()


def test_a_resume_that_fails_leaves_experiment_json_as_it_was(tmp_path, capsys):
    """Every checkpoint unreadable and a changed schedule allowed: exit 2, experiment.json still the run's, and the
    run's own command gets the same checkpoint error, not a refusal over changed settings."""
    saved = trained(tmp_path)
    for step in ("4", "8"):
        for path in (tmp_path / "checkpoints" / step).rglob("*"):
            if path.is_file():
                path.write_bytes(b"garbage")
    run = ["--experiment=mlra4_tiny", f"--workdir={tmp_path}", *MICRO, "--train.eval_every=0"]
    assert train_main([*run, "--train.total_steps=20", "--allow_changed=train.total_steps"]) == 2
    assert "none of the 2 checkpoints" in capsys.readouterr().err
    assert (tmp_path / "experiment.json").read_bytes() == saved
    assert train_main([*run, "--train.total_steps=8"]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 checkpoints" in err and "other settings" not in err


def test_a_changed_model_without_experiment_json_writes_none(tmp_path, capsys):
    trained(tmp_path)
    (tmp_path / "experiment.json").unlink()
    assert train_main(["--experiment=mlra4_tiny", f"--workdir={tmp_path}", *MICRO, "--model.n_embd=32"]) == 2
    assert "none of the 2 checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "experiment.json").exists()  # the wrong model was not recorded


@pytest.mark.parametrize(
    "layout,message",
    [
        ({"run": "file"}, "cannot be a folder: {run} is a file"),
        ({"parent": "file"}, "cannot be a folder: {parent} is a file"),
        ({"run/metrics.jsonl": "folder"}, "metrics.jsonl is a folder, where the run keeps its metrics.jsonl file"),
        ({"run/lock": "folder"}, "lock is a folder, where the run keeps its lock file"),
        ({"run/checkpoints": "file"}, "checkpoints is a file, where the run keeps its checkpoints folder"),
        ({"run/experiment.json": "folder"}, "experiment.json is a folder"),
    ],
    ids=[
        "workdir-is-a-file",
        "workdir-under-a-file",
        "metrics-folder",
        "lock-folder",
        "checkpoints-file",
        "experiment-folder",
    ],
)
def test_a_run_directory_that_cannot_be_used_exits_2_before_anything(tmp_path, capsys, layout, message):
    places = {"run": tmp_path / "run", "parent": tmp_path / "parent"}
    for name, kind in layout.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if kind == "folder" else path.write_text("x")
    workdir = places["parent"] / "run" if "parent" in layout else places["run"]
    before = listing(tmp_path)
    assert train_main(["--experiment=mlra4_tiny", f"--workdir={workdir}", *MICRO]) == 2
    err = capsys.readouterr().err
    assert message.format(**{k: str(v) for k, v in places.items()}) in err and "Traceback" not in err
    assert listing(tmp_path) == before


def test_an_unwritable_run_directory_is_found_before_the_first_step(tmp_path, capsys, monkeypatch):
    """(Checked with a refused probe file: the tests may run as root, whom permissions do not stop.)"""

    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    assert train_main(["--experiment=mlra4_tiny", f"--workdir={tmp_path / 'run'}", *MICRO]) == 2
    assert "is not writable (Permission denied); fix its permissions or use another path" in capsys.readouterr().err
    assert not (tmp_path / "run" / "experiment.json").exists()


def test_binary_bytes_in_metrics_jsonl_are_dropped_on_resume(tmp_path, caplog):
    trained(tmp_path, steps=4)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\x00garbage\n")
    with caplog.at_level("WARNING"):
        assert (
            train(
                micro_experiment("mlra4_tiny", "--train.total_steps=8", "--train.eval_every=0"),
                tmp_path,
                devices=jax.devices()[:1],
                allow_changed=("train.total_steps",),
            ).step
            == 8
        )
    assert "is not a metrics record" in caplog.text
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_unexpected_errors_are_one_line_unless_debugging(tmp_path, capsys, monkeypatch):
    """Exit 1 and one line naming the flag; --debug (or MLRA_JAX_DEBUG=1) lets the traceback through."""
    from mlra_jax import train as train_module

    monkeypatch.setattr(train_module, "apply_overrides", lambda *a: (_ for _ in ()).throw(ZeroDivisionError("x")))
    assert train_main(["--experiment=mlra4_tiny"]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: unexpected ZeroDivisionError: x (run with --debug or MLRA_JAX_DEBUG=1 for the traceback)"
    )
    with pytest.raises(ZeroDivisionError):
        train_main(["--experiment=mlra4_tiny", "--debug"])
    monkeypatch.setenv("MLRA_JAX_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        train_main(["--experiment=mlra4_tiny"])


def test_a_full_disk_exits_2_with_one_message_and_resumes_identically(tmp_path, capsys, monkeypatch):
    """The first checkpoint fails with ENOSPC inside Orbax's writer: exit 2, one line naming the fix; the same
    command then resumes and finishes."""
    import errno

    from mlra_jax import checkpoint

    original = checkpoint.Checkpointer.save

    def full(self, step, state, metadata):
        raise RuntimeError("async save failed") from OSError(
            errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoints" / "4")
        )

    monkeypatch.setattr(checkpoint.Checkpointer, "save", full)
    run = ["--experiment=mlra4_tiny", f"--workdir={tmp_path}", *MICRO, "--train.eval_every=0"]
    assert train_main(run) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left on the device while writing" in err and "Traceback" not in err
    monkeypatch.setattr(checkpoint.Checkpointer, "save", original)
    assert train_main(run) == 0


def test_a_failed_resume_in_a_process_of_its_own_ends_with_one_line(tmp_path):
    """No traceback of Orbax's threads at exit ("Event loop is closed") after the one-line error."""
    trained(tmp_path, steps=4)
    for path in (tmp_path / "checkpoints" / "4").rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")
    result = run_training(tmp_path, "--train.total_steps=4", "--train.eval_every=0", check=False)
    assert result.returncode == 2
    assert "none of the 1 checkpoints" in result.stderr and "Traceback" not in result.stderr
    assert "Event loop is closed" not in result.stderr + result.stdout
