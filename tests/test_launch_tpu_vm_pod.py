"""launch/tpu_vm_pod.sh against a fake `gcloud`: it records every call, and runs each `ssh --command` with
bash on simulated workers (a home folder each), so setup, the detached run, logs and stop really run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

FAKE_GCLOUD = f"""#!{sys.executable}
import json, os, signal, subprocess, sys

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:4] == ["compute", "tpus", "tpu-vm", "describe"]:
    print(os.environ.get("FAKE_ACCELERATOR", ""))
    sys.exit(0)
if args[:3] != ["compute", "tpus", "tpu-vm"]:
    sys.exit(0)
command = args[args.index("--command") + 1]
worker = next(a.split("=", 1)[1] for a in args if a.startswith("--worker="))
homes = sorted(os.environ["FAKE_WORKERS"].split(os.pathsep))
status = 0
for home in homes if worker == "all" else [homes[int(worker)]]:
    env = dict(os.environ, HOME=home)
    process = subprocess.Popen(["bash", "-c", command], env=env, cwd=home, start_new_session=True)
    try:
        status = process.wait(timeout=float(os.environ.get("FAKE_SSH_TIMEOUT", 60))) or status
    except subprocess.TimeoutExpired:  # `tail -F`: the user presses Ctrl-C
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
sys.exit(status)
"""

# uv: `uv venv` makes .venv with a stand-in python that "trains" until SIGTERM; `uv pip` installs nothing.
FAKE_UV = r"""#!/usr/bin/env bash
set -euo pipefail
echo "uv $*" >> "$HOME/uv.log"
if [[ $1 == venv ]]; then
  mkdir -p .venv/bin
  cat > .venv/bin/python <<'EOF'
#!/usr/bin/env bash
[[ $1 == --version ]] && { echo "Python 3.12.9"; exit 0; }
if [[ " $* " == *" --compile_for="* ]]; then echo "compiled with: $*"; exit "${FAKE_PREFLIGHT_EXIT:-0}"; fi
echo "training with: $*"
trap 'echo "SIGTERM: saving a checkpoint"; exit 0' TERM
while :; do sleep 0.1; done
EOF
  chmod +x .venv/bin/python
fi
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def pod(tmp_path):
    """A checkout (with this launcher) whose origin is a local bare repository, two workers, fake tools."""
    origin, checkout = tmp_path / "origin.git", tmp_path / "checkout"
    git(tmp_path, "init", "--quiet", "--bare", str(origin))
    (checkout / "launch").mkdir(parents=True)
    shutil.copy(ROOT / "launch" / "tpu_vm_pod.sh", checkout / "launch")
    git(checkout, "init", "--quiet")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "--allow-empty", "-m", "one")
    git(checkout, "add", "launch")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "two")
    git(checkout, "remote", "add", "origin", str(origin))
    git(checkout, "push", "--quiet", "origin", "HEAD:refs/heads/main")
    git(checkout, "fetch", "--quiet", "origin")
    bin_dir, workers = tmp_path / "bin", [tmp_path / "worker0", tmp_path / "worker1"]
    for directory in (bin_dir, *workers):
        directory.mkdir()
    for name, text in (("gcloud", FAKE_GCLOUD), ("uv", FAKE_UV)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        TPU="pod1",
        ZONE="us-east5-a",
        FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.log"),
        FAKE_WORKERS=os.pathsep.join(map(str, workers)),
    )
    for name in ("REPO", "COMMIT", "PROJECT", "PYTHON_VERSION"):
        env.pop(name, None)
    yield checkout, workers, env
    for worker in workers:  # no stand-in left running if a test failed before `stop`
        pid = worker / "mlra_jax_train.pid"
        if pid.exists():
            subprocess.run(["kill", "-KILL", pid.read_text().strip()], capture_output=True)


def launcher(checkout: Path, env: dict[str, str], *args: str, **changes: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(checkout / "launch" / "tpu_vm_pod.sh"), *args],
        env=dict(env, **changes),
        capture_output=True,
        text=True,
        timeout=120,
    )


def calls(env: dict[str, str]) -> list[list[str]]:
    lines = Path(env["FAKE_GCLOUD_LOG"]).read_text().splitlines() if Path(env["FAKE_GCLOUD_LOG"]).exists() else []
    Path(env["FAKE_GCLOUD_LOG"]).unlink(missing_ok=True)
    return [json.loads(line) for line in lines]


def test_create_setup_run_logs_stop_delete(pod):
    checkout, workers, env = pod
    head = git(checkout, "rev-parse", "HEAD")
    where = ["--zone", "us-east5-a", "--project", "proj"]
    result = launcher(checkout, env, "create", "--spot", ACCELERATOR="v5p-16", VERSION="v2-alpha-tpuv5", PROJECT="proj")
    assert result.returncode == 0, result.stderr
    assert calls(env) == [
        [
            "compute",
            "tpus",
            "queued-resources",
            "create",
            "pod1",
            "--node-id",
            "pod1",
            *where,
            "--accelerator-type",
            "v5p-16",
            "--runtime-version",
            "v2-alpha-tpuv5",
            "--spot",
        ]
    ]

    result = launcher(checkout, env, "setup")  # every worker cloned from origin, at HEAD, Python 3.12 by uv
    assert result.returncode == 0, result.stdout + result.stderr
    [ssh] = calls(env)
    assert ssh[:5] == ["compute", "tpus", "tpu-vm", "ssh", "pod1"] and "--worker=all" in ssh
    for worker in workers:
        assert git(worker / "mlra_jax", "rev-parse", "HEAD") == head
        assert "uv venv --quiet --allow-existing --python 3.12 .venv" in (worker / "uv.log").read_text()
    assert result.stdout.count(f"mlra_jax at {head}, Python 3.12.9") == 2

    # a newer commit reaches workers that already have a clone, local edits there overwritten
    (checkout / "new.txt").write_text("x")
    git(checkout, "add", "new.txt")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "three")
    git(checkout, "push", "--quiet", "origin", "HEAD:refs/heads/main")
    (workers[0] / "mlra_jax" / "launch" / "tpu_vm_pod.sh").write_text("edited on the worker")
    assert launcher(checkout, env, "setup").returncode == 0
    calls(env)
    for worker in workers:
        assert git(worker / "mlra_jax", "rev-parse", "HEAD") == git(checkout, "rev-parse", "HEAD")
        assert git(worker / "mlra_jax", "status", "--porcelain", "--untracked-files=no") == ""

    # the pre-flight compile for the slice's type (from gcloud) on worker 0 refuses a run that does not fit
    result = launcher(
        checkout, env, "run", "--experiment=mlra4_2p9b", FAKE_ACCELERATOR="v5p-16", FAKE_PREFLIGHT_EXIT="2"
    )
    assert result.returncode == 2 and "refused this run" in result.stderr and "nothing was started" in result.stderr
    assert "compiled with: -m mlra_jax.train --compile_for=v5p-16 --experiment=mlra4_2p9b" in result.stdout
    assert [c[3] for c in calls(env)] == ["describe", "ssh"]
    assert not any((w / "mlra_jax_train.pid").exists() for w in workers)
    result = launcher(checkout, env, "run", "--experiment=mlra4_2p9b", FAKE_ACCELERATOR="")
    assert result.returncode == 2 and "set ACCELERATOR" in result.stderr
    calls(env)

    start = time.time()
    result = launcher(
        checkout, env, "run", "--experiment=mlra4_2p9b", "--workdir=/mnt/shared/runs/a b", ACCELERATOR="v5p-16"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled with: -m mlra_jax.train --compile_for=v5p-16 --experiment=mlra4_2p9b" in result.stdout
    assert time.time() - start < 30  # detached: the ssh session ends at once, training goes on
    calls(env)
    pids = [int((w / "mlra_jax_train.pid").read_text()) for w in workers]
    time.sleep(0.5)
    for worker, pid in zip(workers, pids):
        os.kill(pid, 0)  # alive after the session ended
        assert os.getsid(pid) != os.getsid(0)  # in its own session: a hang-up does not reach it
        assert (
            "training with: -m mlra_jax.train --distributed --experiment=mlra4_2p9b --workdir=/mnt/shared/runs/a b"
            in (worker / "mlra_jax_train.log").read_text()
        )
    again = launcher(checkout, env, "run", "--experiment=mlra4_2p9b", PREFLIGHT="0")
    assert again.returncode != 0 and "already training" in again.stderr
    calls(env)

    result = launcher(checkout, env, "logs", "1", LOG_LINES="5", FAKE_SSH_TIMEOUT="2")
    assert "training with:" in result.stdout
    [ssh] = calls(env)
    assert "--worker=1" in ssh and "tail -n 5 -F ~/mlra_jax_train.log" in ssh[-1]

    result = launcher(checkout, env, "stop")
    assert result.returncode == 0 and result.stdout.count("SIGTERM sent") == 2, result.stdout + result.stderr
    calls(env)
    deadline = time.time() + 10
    while time.time() < deadline and any(
        subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode == 0 for p in pids
    ):
        time.sleep(0.1)
    for worker in workers:
        assert "SIGTERM: saving a checkpoint" in (worker / "mlra_jax_train.log").read_text()

    assert launcher(checkout, env, "delete").returncode == 0
    assert calls(env) == [
        ["compute", "tpus", "queued-resources", "delete", "pod1", "--zone", "us-east5-a", "--force", "--quiet"]
    ]


def test_usage_errors_name_the_fix(pod):
    checkout, _, env = pod
    assert launcher(checkout, env).returncode == 2
    result = launcher(checkout, env, "launch")
    assert result.returncode == 2 and "unknown command 'launch'" in result.stderr
    result = launcher(checkout, dict(env, TPU=""), "setup")
    assert result.returncode == 2 and "set TPU" in result.stderr
    result = launcher(checkout, env, "create")
    assert result.returncode == 2 and "set ACCELERATOR" in result.stderr
    result = launcher(checkout, env, "setup", COMMIT="HEAD; rm -rf ~")
    assert result.returncode == 2 and "COMMIT must be" in result.stderr
    result = launcher(checkout, env, "logs", "x")
    assert result.returncode == 2 and "one worker number" in result.stderr
    result = launcher(checkout, env, "run")
    assert result.returncode == 2 and "run needs the training arguments" in result.stderr
    git(checkout, "remote", "remove", "origin")
    result = launcher(checkout, env, "setup")
    assert result.returncode == 2 and "set REPO" in result.stderr
    assert calls(env) == []  # nothing reached gcloud
