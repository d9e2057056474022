"""The trainer's persistent compilation cache: where it goes, and a second run loading its train step from it."""

import os
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, losses, subprocess_env, train_command

from mlra_jax.compilation_cache import JAX_VARIABLE, VARIABLE, chosen_directory


def test_the_directory_is_the_users_cache_unless_jax_has_one_or_it_is_off(tmp_path):
    assert chosen_directory({"XDG_CACHE_HOME": str(tmp_path)}, None) == str(tmp_path / "mlra_jax" / "xla")
    assert chosen_directory({}, None) == os.path.join(os.path.expanduser("~"), ".cache", "mlra_jax", "xla")
    assert chosen_directory({VARIABLE: "~/xla"}, None) == os.path.expanduser("~/xla")
    assert chosen_directory({VARIABLE: "0", "XDG_CACHE_HOME": str(tmp_path)}, None) is None
    assert chosen_directory({JAX_VARIABLE: "/jax"}, None) is None  # JAX reads its own variable
    assert chosen_directory({}, "/configured") is None


@pytest.mark.slow
def test_a_second_run_loads_its_train_step_from_the_cache_and_trains_the_same(tmp_path):
    env = {key: value for key, value in subprocess_env().items() if key not in (JAX_VARIABLE, VARIABLE)}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_DEBUG_LOG_MODULES="jax._src.compiler")

    def run(name: str) -> str:
        command = train_command(tmp_path / name, "--train.total_steps=4", "--train.eval_every=0")
        result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    first = run("first")
    directory = Path(tmp_path / "cache" / "mlra_jax" / "xla")
    assert f"compiled steps are cached in {directory}" in first
    assert "Persistent compilation cache hit for 'jit_step'" not in first
    assert any(entry.name.startswith("jit_step-") for entry in directory.iterdir())
    second = run("second")
    assert "Persistent compilation cache hit for 'jit_step'" in second
    assert losses(tmp_path / "second") == losses(tmp_path / "first")
