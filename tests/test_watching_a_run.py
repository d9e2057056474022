"""A run a person can watch: train() called from Python prints its step lines (stderr not a terminal, no
logging configured), the last loss equals the last step line's, a profiler trace and W&B offline records
come out of the same run, and logging is set up once whatever configured it first."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import ROOT, records, subprocess_env

from mlra_jax.progress import configure_cli_logging, progress_bar, show_library_logs

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

# A script as a user writes it: no logging set up, stderr a pipe (not a terminal).
SCRIPT = """
import sys
sys.path.insert(0, "tests")
from helpers import micro_experiment
from mlra_jax.training.loop import train

experiment = micro_experiment("mlra4_tiny", "--train.total_steps=4", "--train.log_every=2", "--train.eval_every=4",
                              "--checkpoint.every=4", "--profile.start_step=2", "--profile.steps=2",
                              "--metrics.wandb_project=mlra-jax-tests")
result = train(experiment, sys.argv[1])
print(f"RESULT {result.step} {result.last_loss!r}", flush=True)
print("RESUMING", flush=True)  # one step more: the same W&B run continues
train(micro_experiment("mlra4_tiny", "--train.total_steps=5", "--train.log_every=2", "--train.eval_every=0",
                       "--checkpoint.every=4", "--metrics.wandb_project=mlra-jax-tests"), sys.argv[1],
      allow_changed=("train.total_steps",))
"""


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    """(workdir, stdout until the resume, stderr) of SCRIPT run once in a fresh interpreter, W&B offline."""
    workdir = tmp_path_factory.mktemp("watched")
    env = dict(subprocess_env(), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(workdir)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return workdir, done.stdout.split("RESUMING")[0], done.stderr


def test_train_from_python_prints_each_step_line_once_on_stdout(script_run):
    workdir, out, err = script_run
    lines = [line for line in out.splitlines() if " INFO step " in line]
    assert [line.split(" INFO ")[1].split("  ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    logged = records(workdir)
    assert f"loss {logged[2]['loss']:.4f}" in lines[0] and f"val_loss {logged[4]['val_loss']:.4f}" in lines[1]
    assert "initialized a new run" in out and "step 5/5" not in out
    assert "step 2/4" not in err  # not a second time through the root logger's default handler


def test_the_result_reports_the_last_step_lines_loss(script_run):
    workdir, out, _ = script_run
    step, last_loss = out.split("RESULT ")[1].split()
    assert int(step) == 4 and float(last_loss) == records(workdir)[4]["loss"]  # the mean of steps 3-4, not step 4's


def test_the_profiled_steps_leave_a_trace_for_tensorboard_and_perfetto(script_run):
    workdir, out, _ = script_run
    traces = list((workdir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    perfetto = json.loads(gzip.decompress((traces[0].parent / "perfetto_trace.json.gz").read_bytes()))
    assert perfetto["traceEvents"]
    assert "profiling steps 2-3 into" in out


def test_wandb_offline_run_holds_the_same_records(script_run):
    workdir, _, _ = script_run
    run_id = (workdir / "wandb_run_id").read_text().strip()
    run_file = sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))[0]  # before the resume
    content = run_file.read_bytes()
    for step, record in list(records(workdir).items())[:2]:  # steps 2 and 4
        for key in ("loss", "grad_norm", "val_loss"):
            if key in record:  # values are stored as JSON text in the run's protobuf records
                assert json.dumps(record[key]).encode() in content, (step, key)


def test_a_resumed_run_continues_the_same_wandb_run(script_run):
    workdir, _, _ = script_run
    run_id = (workdir / "wandb_run_id").read_text().strip()
    runs = sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2  # one folder per train() that logged, both under the run's id
    assert json.dumps(records(workdir)[5]["loss"]).encode() in (runs[-1] / f"run-{run_id}.wandb").read_bytes()


@contextlib.contextmanager
def unconfigured_logging() -> Iterator[logging.Logger]:
    """Logging as a new interpreter has it (pytest's own handlers set aside), restored afterwards. Used inside
    a test's body: pytest attaches its handlers anew for each phase of a test."""
    root, library = logging.getLogger(), logging.getLogger("mlra_jax")
    saved = root.handlers[:], root.level, library.handlers[:], library.level, library.propagate
    root.handlers, library.handlers, library.propagate = [], [], True
    library.setLevel(logging.NOTSET)
    try:
        yield library
    finally:
        root.handlers, library.handlers, library.propagate = saved[0], saved[2], saved[4]
        root.setLevel(saved[1])
        library.setLevel(saved[3])


def emitted(capsys) -> tuple[str, str]:
    logging.getLogger("mlra_jax.training.loop").info("a step line")
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize("configured_first", ["nothing", "absl's implicit basicConfig", "the entry point"])
def test_library_lines_appear_exactly_once(capsys, configured_first):
    with unconfigured_logging() as library:
        if configured_first == "absl's implicit basicConfig":
            logging.basicConfig()  # what absl.logging does the first time it logs (orbax at import), on stderr
        elif configured_first == "the entry point":
            configure_cli_logging()
        show_library_logs()
        show_library_logs()  # a second train() in the same notebook
        out, err = emitted(capsys)
        assert len(library.handlers) == (0 if configured_first == "the entry point" else 1)
    assert out.count("a step line") == 1 and "a step line" not in err


def test_an_application_logging_setup_is_kept(capsys):
    """An application that configured logging itself gets the lines through its own handlers, once."""
    with unconfigured_logging() as library:
        mine = logging.StreamHandler(sys.stderr)
        mine.setFormatter(logging.Formatter("app: %(message)s"))
        logging.getLogger().addHandler(mine)
        show_library_logs()
        out, err = emitted(capsys)
        assert not library.handlers
    assert err.count("app: a step line") == 1 and not out


def test_a_bar_only_where_one_draws(monkeypatch):
    """A log file or a pipe gets lines only; a terminal gets a tqdm bar over them."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress_bar(total=10, initial=0) is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = progress_bar(total=10, initial=3)
    assert (bar.total, bar.n) == (10, 3)
    bar.close()


def test_a_command_replaces_absls_implicit_handler_and_silences_bars_in_a_log(capsys, monkeypatch):
    """orbax makes absl call basicConfig at import; the command's setup still gives one timestamped stdout line,
    and with stderr not a terminal no library draws a bar."""
    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(name, "restored after the test")
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with unconfigured_logging():
        logging.basicConfig()  # absl's implicit one: stderr, "LEVEL:name:message"
        configure_cli_logging()
        out, err = emitted(capsys)
    assert " INFO a step line" in out and not err
    assert os.environ["TQDM_DISABLE"] == os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
