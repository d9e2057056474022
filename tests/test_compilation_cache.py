"""The trainer's persistent compilation cache: where it goes, and a second run loading its train step from it."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, losses, subprocess_env, train_command

from mlra_jax.compilation_cache import JAX_VARIABLE, VARIABLE, _Repair, chosen_directory


def test_the_directory_is_the_users_cache_unless_jax_has_one_or_it_is_off(tmp_path):
    assert chosen_directory({"XDG_CACHE_HOME": str(tmp_path)}, None) == str(tmp_path / "mlra_jax" / "xla")
    assert chosen_directory({}, None) == os.path.join(os.path.expanduser("~"), ".cache", "mlra_jax", "xla")
    assert chosen_directory({VARIABLE: "~/xla"}, None) == os.path.expanduser("~/xla")
    assert chosen_directory({VARIABLE: "0", "XDG_CACHE_HOME": str(tmp_path)}, None) is None
    assert chosen_directory({JAX_VARIABLE: "/jax"}, None) is None  # JAX reads its own variable
    assert chosen_directory({}, "/configured") is None


@pytest.mark.slow
def test_a_second_run_loads_its_train_step_from_the_cache_and_swapped_entries_exit_2_then_the_next_start_trains(
    tmp_path,
):
    """One run fills the default cache; a second loads its train step from it and trains the same. With the cache
    named by MLRA_JAX_COMPILATION_CACHE holding its init and step programs swapped, train exits 2 naming
    the cache, and the next start trains the same again (four starts: the first run is both tests' first)."""
    env = {key: value for key, value in subprocess_env().items() if key not in (JAX_VARIABLE, VARIABLE)}

    def run(name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        command = train_command(tmp_path / name, "--train.total_steps=4", "--train.eval_every=0")
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)

    def trained(name: str, env: dict[str, str]) -> str:
        result = run(name, env)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    default = dict(env, XDG_CACHE_HOME=str(tmp_path / "cache"), JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    first = trained("first", default)
    directory = Path(tmp_path / "cache" / "mlra_jax" / "xla")
    assert f"compiled steps are cached in {directory}" in first
    assert "Persistent compilation cache hit for 'jit_step'" not in first
    assert any(entry.name.startswith("jit_step-") for entry in directory.iterdir())
    second = trained("second", default)
    assert "Persistent compilation cache hit for 'jit_step'" in second
    assert losses(tmp_path / "second") == losses(tmp_path / "first")

    # the same cache named by the variable, the default moved elsewhere (entries are found only where they were
    # written, and JAX's debug log is part of their key: the same environment otherwise)
    named = dict(default, XDG_CACHE_HOME=str(tmp_path / "elsewhere"), **{VARIABLE: str(directory)})
    init, step = entry(directory, "jit_init"), entry(directory, "jit_step")
    contents = init.read_bytes(), step.read_bytes()
    init.write_bytes(contents[1])
    step.write_bytes(contents[0])
    refused = run("third", named)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert str(directory) in refused.stderr and f"{VARIABLE}=0" in refused.stderr
    trained("third", named)
    assert losses(tmp_path / "third") == losses(tmp_path / "first")


# Two jitted programs with 3 and 1 outputs, compiled under `repairing` with the cache in argv[1] (every compile kept)
PROGRAMS = """
import sys

import jax
import numpy as np

from mlra_jax.command import command
from mlra_jax.compilation_cache import repairing
from mlra_jax.progress import configure_cli_logging

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def three(x):
    return x * 2, x + 1, x.sum()


def one(x):
    return x @ x.T


@command
def main(argv):
    configure_cli_logging()
    with repairing(argv[0]):
        x = np.ones((3, 4), np.float32)
        print("sums", float(jax.jit(three)(x)[2]), float(jax.jit(one)(x).sum()))
    return 0


sys.exit(main(sys.argv[1:]))
"""


def run_programs(cache: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in subprocess_env().items() if key not in (JAX_VARIABLE, VARIABLE)}
    return subprocess.run(
        [sys.executable, "-c", PROGRAMS, str(cache)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def entry(cache: Path, module: str) -> Path:
    (path,) = cache.glob(f"{module}-*-cache")
    return path


@pytest.fixture(scope="module")
def programs_cache(tmp_path_factory) -> tuple[Path, Path]:
    """(the cache of one start of PROGRAMS, a copy of it to restore from)."""
    cache = tmp_path_factory.mktemp("programs") / "xla"
    first = run_programs(cache)
    assert first.returncode == 0 and "sums 12.0 36.0" in first.stdout, first.stderr[-3000:]
    shutil.copytree(cache, cache.with_name("pristine"))
    return cache, cache.with_name("pristine")


@pytest.fixture
def filled_cache(programs_cache) -> Path:
    """The cache of one start of PROGRAMS, as that start left it, for a test to damage: restored in place (JAX finds
    an entry only in the folder that it wrote it to)."""
    cache, pristine = programs_cache
    shutil.rmtree(cache)
    shutil.copytree(pristine, cache)
    return cache


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_an_entry_that_cannot_be_read_is_replaced_with_one_warning_line(filled_cache, damage):
    cache = filled_cache
    damaged = entry(cache, "jit_three")
    good = damaged.read_bytes()
    damaged.write_bytes(good[: len(good) // 2] if damage == "truncated" else b"")

    second = run_programs(cache)
    assert second.returncode == 0 and "sums 12.0 36.0" in second.stdout, second.stderr[-3000:]
    output = second.stdout + second.stderr
    warned = [line for line in output.splitlines() if "compilation cache entry" in line]
    assert len(warned) == 1 and "could not be read" in warned[0] and f"{VARIABLE}=0" in warned[0], output
    assert str(cache) in warned[0] and "UserWarning" not in output and "Traceback" not in output
    assert len(entry(cache, "jit_three").read_bytes()) > len(good) // 2  # written anew by this start
    third = run_programs(cache)
    assert third.returncode == 0 and "compilation cache" not in third.stdout + third.stderr


def test_swapped_entries_fail_one_start_naming_the_cache_which_is_emptied_so_the_next_start_compiles(filled_cache):
    cache = filled_cache
    three, one = entry(cache, "jit_three"), entry(cache, "jit_one")
    contents = three.read_bytes(), one.read_bytes()
    three.write_bytes(contents[1])
    one.write_bytes(contents[0])

    second = run_programs(cache)
    assert second.returncode == 2, second.stdout + second.stderr
    (line,) = second.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: ") and str(cache) in line and f"{VARIABLE}=0" in line, line
    assert "Traceback" not in second.stderr and not list(cache.glob("*-cache"))  # no entry is trusted
    third = run_programs(cache)
    assert third.returncode == 0 and "sums 12.0 36.0" in third.stdout, third.stderr[-3000:]


# JAX's own texts (jax._src.compiler): the miss line before a compile, the warning of a failed write
_MISS_LINE = "PERSISTENT COMPILATION CACHE MISS for '%s' with key %r"
_WRITE_ERROR = "Error writing persistent compilation cache entry for 'jit_step'"


def test_an_entry_a_full_disk_left_truncated_is_removed(tmp_path, caplog):
    key = "jit_step-" + "ab" * 32
    (tmp_path / f"{key}-cache").write_bytes(b"\x28\xb5")  # the first bytes of a write that ran out of space
    (tmp_path / ("jit_step-" + "cd" * 32 + "-cache")).write_bytes(b"another configuration's step")
    repair = _Repair(tmp_path, logging.WARNING)
    miss = logging.LogRecord("jax._src.compiler", logging.DEBUG, "", 0, _MISS_LINE, ("jit_step", key), None)
    assert repair.filter(miss) is False  # JAX's debug line stays hidden
    with caplog.at_level(logging.WARNING):
        assert repair.show(UserWarning(f"{_WRITE_ERROR}: OSError: [Errno 28] No space left on device"))
    assert [p.name for p in tmp_path.iterdir()] == ["jit_step-" + "cd" * 32 + "-cache"]
    (line,) = caplog.messages
    assert f"{key} in {tmp_path} could not be written" in line and "No space left" in line and f"{VARIABLE}=0" in line
    assert not repair.show(UserWarning("something else"))  # shown as before
