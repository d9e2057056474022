"""Shared test helpers. Tests run on CPU; 8 virtual devices serve the sharding tests, and XLA
compiles with cheap CPU backend passes (the suite is compile-bound; results do not depend on it)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

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
