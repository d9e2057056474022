"""The README's quick start and CI stay in step, and the commands the README and the getting-started page print
after the quick start run as printed: from a folder whose .venv is the tests' virtual environment, with no
JAX_PLATFORMS set (as a user's shell has none), and without a line of the TPU runtime's."""

import fcntl
import os
import pty
import re
import shlex
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from helpers import GPT2, MICRO
from xla_test_flags import SUBPROCESS

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
TPU_NOISE = ("E0000", "accelerator type", "TPU_WORKER_HOSTNAMES")


def test_ci_runs_the_readme_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if "pytest" in line)
    assert test_command in readme


def test_auto_takes_one_worker_more_than_the_cpus(monkeypatch):
    """The README's `-n auto` runs EXTRA_WORKERS more workers than CPUs (the suite waits on subprocesses and disks),
    and PYTEST_XDIST_AUTO_NUM_WORKERS still decides where it is set."""
    import conftest

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == len(os.sched_getaffinity(0)) + 1
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")
    assert conftest.pytest_xdist_auto_num_workers(None) is None  # xdist's hook takes the variable


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def quick_start_training(page: Path) -> str:
    """The training part of the quick start's first command (after its set-up)."""
    lines = [line for block in bash_blocks(page.read_text()) for line in block.splitlines()]
    return next(line for line in lines if ".venv/bin/mlra train" in line).split("&&")[-1].strip()


def follow_up_block(page: Path) -> str:
    """The bash block after the quick start ("Then, ..."): what a new user runs next."""
    text = page.read_text()
    return bash_blocks(text[text.index("\nThen") :])[0]


def test_both_pages_print_the_same_quick_start():
    readme, started = (bash_blocks(page.read_text()) for page in PAGES)
    quick = next(block for block in readme if "mlra train --experiment=mlra4_tiny" in block)
    assert quick in started
    for page in PAGES:
        block = follow_up_block(page)
        assert block.startswith("source .venv/bin/activate\n") and "python -m" not in block, page


def on_a_terminal(command: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> tuple[int, str]:
    """(exit code, what a 120-column terminal showed) of `command` run by bash with its stdio on a pseudo-terminal."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        ["bash", "-c", command], cwd=cwd, env=env, stdin=follower, stdout=follower, stderr=follower
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the terminal's last writer exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_the_commands_after_the_quick_start_run_as_printed(tmp_path):
    venv = Path(sys.prefix)
    if not (venv / "bin" / "mlra").exists():
        pytest.skip(f"the tests run from {venv}, not a virtual environment with mlra installed")
    (tmp_path / ".venv").symlink_to(venv)
    # as a new user's shell has it: without the test session's platform flags and without the progress-bar switches
    # that in-process commands run earlier in this worker set (mlra_jax.progress: a command writing into a pipe)
    dropped = ("JAX_PLATFORMS", "XLA_FLAGS", "VIRTUAL_ENV", "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, whichever checkout the venv was installed from
    env["XLA_FLAGS"] = SUBPROCESS  # the training subprocesses' compile settings (they change no result)

    # the quick start's training as printed, on a terminal, made tiny by overrides
    training = f"{quick_start_training(PAGES[0])} {shlex.join(MICRO + GPT2)}"
    code, shown = on_a_terminal(training, tmp_path, env)
    assert code == 0, shown[-3000:]
    assert "compiling the train step..." in shown and "training: 100%" in shown
    assert re.search(r"\| 12/12 \[[0-9:]+<00:00, .*loss [0-9.]+, [0-9,]+ tokens/s\]", shown), shown[-3000:]
    assert not [noise for noise in TPU_NOISE if noise in shown], shown[:3000]

    # every line of both pages' blocks, each line once (the pages share most of them), in one activated shell
    lines = list(dict.fromkeys(line for page in PAGES for line in follow_up_block(page).splitlines()))
    done = subprocess.run(
        ["bash", "-e", "-c", "\n".join(lines)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert not [noise for noise in TPU_NOISE if noise in output], output[:3000]
    assert "--- 'The return value' (checkpoint step 12)" in done.stdout and "average" in done.stdout
    assert "mlra4_2p9b" in done.stdout and "--model.n_layer" in done.stdout  # info, train --help
    assert (tmp_path / "runs" / "mlra4_tiny" / "curves.png").exists() and not (tmp_path / "curves.png").exists()
