"""A mismatched or corrupt reference state_dict fails clearly and leaves the model untouched."""

import dataclasses

import numpy as np
import pytest
from conftest import GOLDEN_DIR, load_golden

from mlra_jax.interop import StateDictError, load_state_dict
from mlra_jax.model import init_model
from mlra_jax.params import flat_params

CFG, STATE_DICT, TOKENS, LOGITS = load_golden(GOLDEN_DIR / "mlra_4.npz")


def assert_fails_and_keeps_model(state_dict, message, cfg=CFG):
    model = init_model(cfg)
    before = {k: np.asarray(v) for k, v in flat_params(model).items()}
    with pytest.raises(StateDictError, match=message):
        load_state_dict(model, state_dict)
    for name, value in flat_params(model).items():
        np.testing.assert_array_equal(np.asarray(value), before[name])


def test_missing_tensor():
    broken = {k: v for k, v in STATE_DICT.items() if k != "transformer.h.1.attn.kv_b_proj"}
    assert_fails_and_keeps_model(broken, r"1 missing \(e.g. transformer.h.1.attn.kv_b_proj\)")


def test_other_variant_is_named():
    _, mla_state_dict, _, _ = load_golden(GOLDEN_DIR / "mla.npz")
    assert_fails_and_keeps_model(mla_state_dict, "does not match variant 'mlra4'.*looks like mla; build the model")


def test_wrong_shape():
    broken = dict(STATE_DICT, **{"transformer.h.0.attn.q_b_proj.weight": np.zeros((90, 32), np.float16)})
    assert_fails_and_keeps_model(broken, r"q_b_proj.weight: expected \(96, 32\), got \(90, 32\)")


def test_wrong_layer_count():
    assert_fails_and_keeps_model(
        STATE_DICT,
        "state_dict has 2 layers but the config has n_layer=3; set n_layer=2",
        cfg=dataclasses.replace(CFG, n_layer=3),
    )


def test_untied_head():
    broken = dict(STATE_DICT, **{"lm_head.weight": STATE_DICT["transformer.wte.weight"] + 1})
    assert_fails_and_keeps_model(broken, "lm_head.weight differs from transformer.wte.weight")


def test_non_finite_values():
    poisoned = STATE_DICT["transformer.h.0.mlp.c_fc1.weight"].copy()
    poisoned[3, 4] = np.nan
    assert_fails_and_keeps_model(
        dict(STATE_DICT, **{"transformer.h.0.mlp.c_fc1.weight": poisoned}), "NaN or inf.*c_fc1"
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_non_finite_values_in_every_float_dtype(dtype):
    """bfloat16 is no numpy float type, so a plain numpy check lets its NaN through."""
    import ml_dtypes

    poisoned = STATE_DICT["transformer.h.0.mlp.c_proj.weight"].astype(getattr(ml_dtypes, dtype, dtype))
    poisoned[1, 2] = -np.inf if dtype == "float16" else np.nan
    assert_fails_and_keeps_model(
        dict(STATE_DICT, **{"transformer.h.0.mlp.c_proj.weight": poisoned}), "NaN or inf.*c_proj"
    )


def test_values_that_overflow_the_parameter_dtype():
    big = STATE_DICT["transformer.h.1.attn.c_proj.weight"].astype(np.float64)
    big[0, 0] = 1e39  # finite in float64, inf in float32
    assert_fails_and_keeps_model(
        dict(STATE_DICT, **{"transformer.h.1.attn.c_proj.weight": big}),
        r"beyond the largest float32 .*c_proj.weight \(\|x\| up to 1e\+39\)",
    )
    half = dataclasses.replace(CFG, param_dtype="float16")
    large = STATE_DICT["transformer.h.1.attn.c_proj.weight"].astype(np.float32)
    large[0, 0] = 7e4
    assert_fails_and_keeps_model(
        dict(STATE_DICT, **{"transformer.h.1.attn.c_proj.weight": large}), "beyond the largest float16", cfg=half
    )


def test_tied_head_and_torch_style_inputs_are_accepted():
    model = init_model(CFG)
    state_dict = dict(STATE_DICT, **{"lm_head.weight": STATE_DICT["transformer.wte.weight"]})
    load_state_dict(model, state_dict)
    assert np.abs(np.asarray(model(TOKENS)) - LOGITS).max() < 1e-4
