"""Runs in subprocesses: SIGKILLs then resume is exact, SIGTERM checkpoints, checkpoints change meshes."""

import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT, logged_step, losses, records, run_training, saved_steps, subprocess_env, train_command
from xla_test_flags import SUBPROCESS

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

# checkpoints every 2 steps (so kills often land in a save), averaged log lines every 3
STEPS = 36
MANY = [f"--train.total_steps={STEPS}", "--checkpoint.every=2", "--train.log_every=3", "--train.eval_every=10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The workdir of a run of MANY from start to end: what the interrupted runs of the tests must equal."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    run_training(workdir, *MANY)
    return workdir


def start_and_wait(workdir, min_step):
    """Start a run of MANY and return it once it has logged step `min_step` or a later one (still running)."""
    process = subprocess.Popen(
        train_command(workdir, *MANY),
        env=subprocess_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        if logged_step(workdir) >= min_step:
            break
        if process.poll() is not None:
            pytest.fail(f"the run ended before step {min_step}:\n{process.stdout.read()[-3000:]}")
        time.sleep(0.01)
    assert process.poll() is None, "the run finished before it could be interrupted"
    return process


def saving(workdir):
    return any((workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


def kill_at_a_random_moment(workdir, rng, mid_save):
    """Run until a checkpoint newer than the resumed one exists, then SIGKILL at once while a save is in
    flight (mid_save) or after a random pause of up to about one step (a step and its save take 50-100 ms
    here). True if the kill landed in a save."""
    resumed_from = max(saved_steps(workdir), default=0)
    process = subprocess.Popen(
        train_command(workdir, *MANY),
        env=subprocess_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while max(saved_steps(workdir), default=0) <= resumed_from and time.time() < deadline:
        assert process.poll() is None, "the run ended before it could be killed"
        time.sleep(0.005)
    if mid_save:
        for _ in range(2000):
            if saving(workdir) or process.poll() is not None:
                break
            time.sleep(0.001)
    else:
        time.sleep(rng.uniform(0, 0.1))
    in_save = saving(workdir)
    process.kill()
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before the kill"
    return in_save


def final_weights(workdir):
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(STEPS) / "state")


def test_four_kills_at_random_moments_leave_metrics_and_weights_bit_identical(tmp_path, uninterrupted):
    rng, workdir = random.Random(2026), tmp_path / "killed"
    in_save = [kill_at_a_random_moment(workdir, rng, mid_save=k % 2 == 1) for k in range(4)]
    assert any(in_save), "no kill landed in a save"
    assert max(saved_steps(workdir)) < STEPS
    run_training(workdir, *MANY)
    assert records(workdir) == records(uninterrupted)  # loss averages, grad norms, lr, val_loss: exact
    whole, killed = final_weights(uninterrupted), final_weights(workdir)
    assert jax_tree_equal(whole, killed)


def jax_tree_equal(a, b):
    import jax

    leaves = jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))
    return len(leaves) > 0 and all(leaves)


def test_sigterm_saves_a_checkpoint_before_exiting(tmp_path, uninterrupted):
    process = start_and_wait(tmp_path, min_step=10)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "stop signal received: saving a checkpoint at step" in output
    stopped = int(output.split("stopped at step ")[1].split()[0])
    assert 10 <= stopped < STEPS
    assert (tmp_path / "checkpoints" / str(stopped) / "state").is_dir()
    result = run_training(tmp_path, *MANY)
    assert f"resumed from {tmp_path / 'checkpoints' / str(stopped)}" in result.stdout
    assert records(tmp_path) == records(uninterrupted)


def test_checkpoint_from_8_devices_restores_on_1_and_4(tmp_path):
    source, run = tmp_path / "eight", ["--train.total_steps=12", "--train.eval_every=0"]
    run_training(source, *run, "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2", devices=8)
    shutil.rmtree(source / "checkpoints" / "12")  # as if the 8-device job had stopped after step 8
    eight = losses(source)
    continued = {}
    for devices, mesh in ((1, ["--mesh.data=1"]), (4, ["--mesh.data=1", "--mesh.fsdp=4"])):
        workdir = tmp_path / f"on{devices}"
        shutil.copytree(source, workdir)
        result = run_training(workdir, *run, *mesh, devices=devices)
        assert f"resumed from {workdir / 'checkpoints' / '8'}" in result.stdout
        assert f"over {devices} devices" in result.stdout
        continued[devices] = [losses(workdir)[s] for s in range(9, 13)]
    # the continuations agree with each other and with the 8-device run's own steps 9-12
    np.testing.assert_allclose(continued[1], continued[4], rtol=2e-5)
    np.testing.assert_allclose(continued[1], [eight[s] for s in range(9, 13)], rtol=2e-5)


def test_two_processes_train_like_one(tmp_path):
    """launch/local.sh: 2 processes x 2 CPU devices see the same global batches as 1 process x 4."""
    run = ["--train.total_steps=6", "--train.eval_every=3"]
    run_training(tmp_path / "one", *run, devices=4)
    env = dict(subprocess_env(), DEVICES_PER_PROCESS="2", PYTHON=sys.executable)
    env["XLA_FLAGS"] = SUBPROCESS  # launch/local.sh adds the device count
    result = subprocess.run(
        ["bash", "launch/local.sh", "2", *train_command(tmp_path / "two", *run)[3:]],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == list(range(1, 7))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-6)
