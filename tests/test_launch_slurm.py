"""launch/slurm_gpu.sbatch run on this machine: a fake `srun` starts the tasks with SLURM's environment."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MICRO, ROOT, logged_step, losses, saved_steps, subprocess_env

from mlra_jax.distributed import expand_tasks_per_node, first_host, slurm_task

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

# srun as SLURM runs it: SLURM_NNODES x SLURM_NTASKS_PER_NODE tasks, each with the step's variables, the
# output merged, signals forwarded, and --kill-on-bad-exit (the other tasks killed when one fails).
FAKE_SRUN = r"""#!/usr/bin/env bash
set -euo pipefail
while [[ $1 == -* ]]; do shift; done
nodes=$SLURM_NNODES per_node=${SLURM_NTASKS_PER_NODE:-1}
pids=()
for ((node = 0; node < nodes; node++)); do
  for ((local = 0; local < per_node; local++)); do
    SLURM_STEP_ID=0 SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_NUM_NODES=$nodes \
      SLURM_NTASKS=$((nodes * per_node)) SLURM_STEP_NUM_TASKS=$((nodes * per_node)) \
      SLURM_STEP_TASKS_PER_NODE="$per_node(x$nodes)" SLURM_NODEID=$node SLURM_LOCALID=$local \
      SLURM_PROCID=$((node * per_node + local)) "$@" &
    pids+=($!)
  done
done
printf '%s\n' "${pids[@]}" > "${FAKE_SRUN_PIDS:-/dev/null}"
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM
declare -A reaped
status=0
while :; do
  alive=0
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then alive=1; continue; fi
    [[ -n ${reaped[$pid]:-} ]] && continue
    reaped[$pid]=1
    wait "$pid" && code=0 || code=$?
    if ((code != 0)); then status=$code; kill -KILL "${pids[@]}" 2>/dev/null || true; fi
  done
  ((alive)) || break
  sleep 0.05
done
exit "$status"
"""
FAKE_SCONTROL = '#!/usr/bin/env bash\necho "$*" >> "$FAKE_SCONTROL_LOG"\n'
STEPS = 24  # at 20-50 ms a step, room for a signal to land before the end
RUN = [*MICRO, f"--train.total_steps={STEPS}", "--checkpoint.every=2", "--train.eval_every=0"]


def sbatch_env(tmp_path: Path, nodes: int = 2, per_node: int = 1) -> dict[str, str]:
    """The environment of the batch script as sbatch starts it (4 CPU devices per node)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_id = str(random.randrange(10_000, 1_000_000))  # the coordinator port follows from it, as under SLURM
    nodelist = "localhost" if nodes == 1 else f"localhost,node[2-{nodes}]"  # the first node is this machine
    return dict(
        subprocess_env(devices=4),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHON=sys.executable,
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NODELIST=nodelist,
        SLURM_NODELIST=nodelist,
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(nodes * per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_SUBMIT_DIR=str(ROOT),
        FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        FAKE_SRUN_PIDS=str(tmp_path / "pids"),
    )


def sbatch(workdir: Path, *args: str) -> list[str]:
    return ["bash", "launch/slurm_gpu.sbatch", "--experiment=mlra4_tiny", f"--workdir={workdir}", *RUN, *args]


def run_sbatch(workdir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(sbatch(workdir, *args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def start_sbatch(
    workdir: Path, env: dict[str, str], min_step: int, *args: str, checkpointed: bool = False
) -> subprocess.Popen:
    """Start the batch script and return it once training has logged step `min_step` or a later one (and, with
    `checkpointed`, finished a checkpoint of this job: under load a save can still be in flight at that step)."""
    process = subprocess.Popen(
        sbatch(workdir, *args), env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    before = saved_steps(workdir)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if logged_step(workdir) >= min_step and (not checkpointed or saved_steps(workdir) != before):
            return process
        time.sleep(0.01)
    process.kill()
    pytest.fail(f"training ended or stalled before step {min_step}:\n{process.communicate()[0][-4000:]}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("slurm")
    result = run_sbatch(tmp_path / "run", sbatch_env(tmp_path))
    return result.stdout, losses(tmp_path / "run")


def test_one_task_per_node_drives_every_local_device(uninterrupted):
    """2 nodes x 4 devices: each task sees its node's 4 devices (no GPU restriction), the mesh spans 8."""
    output, run_losses = uninterrupted
    lines = re.findall(
        r"distributed: process (\d) of 2 \(SLURM, 1 task per node, all its GPUs\), coordinator "
        r"localhost:(\d+), (\d) local devices \(GPUs visible: (\w+)\), (\d) devices in all",
        output,
    )
    assert sorted(line[0] for line in lines) == ["0", "1"], output[-4000:]
    assert all(line[2:] == ("4", "all", "8") for line in lines), lines
    assert re.search(r"mesh \{.*\} over 8 devices", output), output[-4000:]
    assert sorted(run_losses) == list(range(1, STEPS + 1))


def test_one_task_per_gpu_gets_its_own_gpu(tmp_path):
    """--ntasks-per-node=2: task LOCALID is given GPU LOCALID (a dry run: no training)."""
    env = sbatch_env(tmp_path, nodes=1, per_node=2)
    result = run_sbatch(tmp_path / "run", env, "--dry_run")
    visible = dict(
        re.findall(r"process (\d) of 2 \(SLURM, 2 tasks per node, 1 GPU each\).*GPUs visible: (\w+)", result.stdout)
    )
    assert visible == {"0": "0", "1": "1"}, result.stdout[-4000:]


def test_a_killed_task_then_a_time_limit_notice_and_the_requeued_job_resume_exactly(tmp_path, uninterrupted):
    """A task killed (node 2 dies) ends the job; the same command resumes, until a time-limit notice makes it
    checkpoint (the only checkpoint it saves) and requeue; the requeued job resumes from that checkpoint; the losses
    equal the uninterrupted run's, step for step. (One job per interruption: the second resumes the first's run.)"""
    env, run = sbatch_env(tmp_path), tmp_path / "run"
    process = start_sbatch(run, env, min_step=3, checkpointed=True)
    os.kill(int((tmp_path / "pids").read_text().split()[1]), signal.SIGKILL)  # node 2 dies
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0, output[-4000:]  # srun --kill-on-bad-exit ended the other task
    killed_at = max(losses(run))
    assert killed_at < STEPS

    no_periodic_saves = "--checkpoint.every=1000"  # the stop saves the only checkpoint of this job
    process = start_sbatch(run, env, killed_at + 1, no_periodic_saves)
    process.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends before the time limit
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-4000:]
    assert re.search(r"resumed from .*checkpoints/\d+", output), output[-4000:]
    stops = re.findall(r"stop signal received: saving a checkpoint at step (\d+)", output)
    assert len(stops) == 2 and stops[0] == stops[1], output[-4000:]
    assert killed_at < int(stops[0]) < STEPS
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {env['SLURM_JOB_ID']}\n"
    assert (run / "checkpoints" / stops[0] / "state").is_dir()
    result = run_sbatch(run, env, no_periodic_saves)  # the requeued job runs the same script again
    assert f"checkpoints/{stops[0]}" in result.stdout
    assert losses(run) == uninterrupted[1]  # float equality, step for step


def test_slurm_settings_from_the_environment():
    assert first_host("gpu[001-004]") == "gpu001"
    assert first_host("node[001,007-015],host2") == "node001"
    assert first_host("a7,b9") == "a7"
    assert expand_tasks_per_node("8(x2),1") == [8, 8, 1]
    step = dict(
        SLURM_JOB_ID="12345",
        SLURM_STEP_NODELIST="gpu[001-004]",
        SLURM_NTASKS="4",
        SLURM_PROCID="2",
        SLURM_LOCALID="0",
        SLURM_STEP_TASKS_PER_NODE="1(x4)",
        SLURM_NODEID="2",
    )
    task = slurm_task(step)
    assert (task.coordinator, task.num_processes, task.process_id, task.local_device_ids) == (
        "gpu001:61497",
        4,
        2,
        None,
    )  # JAX alone would say local_device_ids=[0]: GPU 0 only
    per_gpu = dict(
        step,
        SLURM_NTASKS="32",
        SLURM_PROCID="13",
        SLURM_LOCALID="5",
        SLURM_STEP_TASKS_PER_NODE="8(x4)",
        SLURM_NODEID="1",
    )
    assert slurm_task(per_gpu).local_device_ids == [5]
    assert slurm_task(dict(per_gpu, CUDA_VISIBLE_DEVICES="5")).local_device_ids is None  # bound by SLURM already
    assert slurm_task(dict(per_gpu, JAX_COORDINATOR_PORT="1234")).coordinator == "gpu001:1234"
    assert slurm_task({"SLURM_JOB_ID": "1"}) is None  # not inside an srun step: JAX's own detection
