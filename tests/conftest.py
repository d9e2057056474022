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
# Pallas's Mosaic GPU interpreter runs each simulated warpgroup as its own XLA computation, and a barrier wait
# blocks a thread of the XLA CPU client's pool (one per core unless PJRT_NPROC says): a kernel of three warpgroups
# deadlocks on two cores when the consumers take both threads first (tests/test_mlra_attention_kernel.py).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 4)))


def pytest_configure(config) -> None:
    """The controller (or a run without xdist) makes the session's compilation cache; workers inherit it."""
    if not hasattr(config, "workerinput") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.compile_cache = tempfile.mkdtemp(prefix="mlra_jax_test_compile_cache_")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config.compile_cache


def pytest_unconfigure(config) -> None:
    if hasattr(config, "compile_cache"):
        shutil.rmtree(config.compile_cache, ignore_errors=True)


# Modules whose module fixtures train or export a model: xdist gives each of them whole to one worker, so
# that the fixture runs once. (--dist loadgroup would do it, but its xdist_group marks are ignored under
# pytest 9.2: pytest-xdist issue 1386.)
SHARED_FIXTURE_MODULES = {
    "test_convert.py",
    "test_convert_hf.py",
    "test_eval_ppl.py",
    "test_launch_slurm.py",
    "test_lm_eval.py",
    "test_watching_a_run.py",
    "test_command_faults.py",
    "test_nonfinite_weights.py",
}
# Handed out first (after those modules), so that no test of a minute or more starts at the end of the run
LONG_FIRST = ["test_resume.py"]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's default (--dist load) with the SHARED_FIXTURE_MODULES each in one piece."""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):  # scopes of several tests go first, then single tests in order
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if Path(module).name in SHARED_FIXTURE_MODULES else nodeid

    return Scheduling(config, log)


def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: the rest keep their order


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
