"""The MLRA training attention kernel's cases (mlra_attention_kernel_cases.py) in a pytest process of their own with
PJRT_NPROC=4: Pallas's GPU interpreter runs each simulated warpgroup as an XLA CPU computation, and a barrier wait
holds one thread of the CPU client's pool (one per core unless PJRT_NPROC says), so the kernel's three warpgroups
can deadlock on a 2-core machine. The rest of the suite keeps the default pool."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("mlra_attention_kernel_cases.py")


def run_cases(marker: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-x", "-p", "no:cacheprovider", "-m", marker],
        env={**os.environ, "PJRT_NPROC": "4"},
        cwd=CASES.parents[1],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_the_kernel_equals_its_reference_and_the_training_path():
    run_cases("not slow")


@pytest.mark.slow
def test_the_kernel_at_the_2p9b_models_width():
    run_cases("slow")
