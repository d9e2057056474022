"""The MLRA training attention kernel's cases (mlra_attention_kernel_cases.py) in a pytest process of their own
(helpers.run_interpreted_cases: Pallas's GPU interpreter can deadlock a 2-core machine's default CPU client)."""

from pathlib import Path

import pytest
from helpers import run_interpreted_cases

CASES = Path(__file__).with_name("mlra_attention_kernel_cases.py")


def test_the_kernel_equals_its_reference_and_the_training_path():
    run_interpreted_cases(CASES, "not slow")


@pytest.mark.slow
def test_the_kernel_at_the_2p9b_models_width():
    run_interpreted_cases(CASES, "slow")
