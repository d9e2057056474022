"""Shared test helpers. Tests run on CPU; 8 virtual devices serve the sharding tests, and XLA
compiles with cheap CPU backend passes (the suite is compile-bound; results do not depend on it). One
persistent compilation cache serves the whole session: both xdist workers and every subprocess."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from xla_test_flags import IN_PROCESS

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {IN_PROCESS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_configure(config) -> None:
    """The controller (or a run without xdist) makes the session's compilation cache; workers inherit it."""
    if not hasattr(config, "workerinput") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.compile_cache = tempfile.mkdtemp(prefix="mlra_jax_test_compile_cache_")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config.compile_cache


def pytest_unconfigure(config) -> None:
    if hasattr(config, "compile_cache"):
        shutil.rmtree(config.compile_cache, ignore_errors=True)


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
