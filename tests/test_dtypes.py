"""bfloat16 compute (float32 params) stays close to float32 for every variant."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN_FILES, load_golden

from mlra_jax.interop import load_state_dict
from mlra_jax.model import init_model

# bfloat16 keeps 8 mantissa bits (~0.4% per rounding). On the golden models, whose random
# weights give logits up to ~30, float32 vs bfloat16 compute differ by at most 5% of the
# largest logit and 1.6e-3 nats of KL (measured); the bounds leave headroom for XLA versions.
MAX_ABS_RELATIVE = 0.08
MEAN_KL = 3e-3


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_bfloat16_logits_close_to_float32(path):
    cfg, state_dict, tokens, expected = load_golden(path)
    model = init_model(dataclasses.replace(cfg, compute_dtype="bfloat16"))
    load_state_dict(model, state_dict)
    state = jax.tree.leaves(model.blocks.attn)[0]
    assert state.dtype == jnp.float32  # parameters stay float32
    logits = np.asarray(model(tokens))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    assert np.abs(logits - expected).max() <= MAX_ABS_RELATIVE * np.abs(expected).max()
    log_p, log_q = jax.nn.log_softmax(expected), jax.nn.log_softmax(logits)
    assert float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean()) <= MEAN_KL
