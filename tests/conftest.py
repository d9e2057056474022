"""Shared test helpers. Tests run on CPU; 8 virtual devices serve the sharding tests, and XLA
compiles with cheap CPU backend passes (the suite is compile-bound; results do not depend on it). One
persistent compilation cache serves the whole session: both xdist workers and every subprocess."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from xla_test_flags import IN_PROCESS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":  # JAX_PLATFORMS=cuda pytest -m gpu: the GPU's XLA rejects the CPU flags
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {IN_PROCESS}")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_configure(config) -> None:
    """The controller (or a run without xdist) makes the session's compilation cache; workers inherit it."""
    if not hasattr(config, "workerinput") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.compile_cache = tempfile.mkdtemp(prefix="mlra_jax_test_compile_cache_")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config.compile_cache


def pytest_unconfigure(config) -> None:
    if hasattr(config, "compile_cache"):
        shutil.rmtree(config.compile_cache, ignore_errors=True)


# Modules whose module fixtures train, export or fill a cache: xdist gives each of them whole to one worker, so
# that the fixture runs once. (--dist loadgroup would do it, but its xdist_group marks are ignored under
# pytest 9.2: pytest-xdist issue 1386; --dist worksteal splits modules between the workers.)
SHARED_FIXTURE_MODULES = {
    "test_convert.py",
    "test_convert_hf.py",
    "test_eval_ppl.py",
    "test_launch_slurm.py",
    "test_lm_eval.py",
    "test_watching_a_run.py",
    "test_command_faults.py",
    "test_nonfinite_weights.py",
    "test_compilation_cache.py",
}
# Tests that share a module fixture with each other only (the module's other tests go one by one): module ->
# the names' beginnings
SHARED_FIXTURE_TESTS = {"test_resume.py": ("test_four_kills", "test_sigterm")}  # the uninterrupted run
# Handed out first, longest first (the tests of half a minute or more, by their durations on 2 cores), so that no
# long test starts near the end of the run while the other worker runs out of work
LONG_FIRST = [
    "test_mlra_attention_kernel.py",
    "test_readme.py::test_the_commands_after_the_quick_start_run_as_printed",
    "test_resume.py::test_four_kills",
    "test_launch_slurm.py",
    "test_notebooks.py::test_runs_top_to_bottom_on_a_cpu",
    "test_benchmarks.py::test_decode_throughput_on_8_devices",
    "test_resume.py",
    "test_compilation_cache.py",
    "test_kernels.py::test_the_mosaic_gpu_kernel_in_interpret_mode",
]


# -n auto's workers beyond one per CPU: part of the suite waits on subprocesses' starts and checkpoint writes, and a
# third worker on 2 cores fills it (the whole suite: 16:21 with 3 workers, 17:11 with 4, 19:08 with 2)
EXTRA_WORKERS = 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int | None:
    """-n auto: EXTRA_WORKERS more than this process may use CPUs, unless PYTEST_XDIST_AUTO_NUM_WORKERS says."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return len(os.sched_getaffinity(0)) + EXTRA_WORKERS


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's --dist load (what -n gives) with each of the SHARED_FIXTURE_MODULES in one piece, in the order of
    pytest_collection_modifyitems: a worker takes the next test (or shared module) as it runs out of work."""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection's order (LONG_FIRST first), not the largest piece first

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, name = nodeid.split("::")[0], nodeid.split("::")[-1]
            if Path(module).name in SHARED_FIXTURE_MODULES:
                return module
            if name.startswith(SHARED_FIXTURE_TESTS.get(Path(module).name, ())):
                return f"{module}::shared fixtures"
            return nodeid

    return Scheduling(config, log)


def _first(item) -> int:
    nodeid = item.nodeid.split("/")[-1]
    return next((i for i, prefix in enumerate(LONG_FIRST) if nodeid.startswith(prefix)), len(LONG_FIRST))


def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=_first)  # stable: the rest keep their order


GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_FILES = sorted(GOLDEN_DIR.glob("*.npz"))


def load_golden(path: Path):
    """(ModelConfig, reference state_dict, tokens, logits) of a golden fixture."""
    from mlra_jax.interop.reference_config import config_from_reference

    data = np.load(path)
    fields = json.loads(str(data["config"]))
    cfg = config_from_reference(fields, fields.pop("reference_model"))
    state_dict = {k.removeprefix("state_dict/"): data[k] for k in data.files if k.startswith("state_dict/")}
    return cfg, state_dict, data["tokens"], data["logits"]
