"""The shared attention against a direct transcription of the reference (repeat_interleave)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlra_jax.attention.core import attention, causal_mask


def reference_attention(q, k, v, scale, mask):
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)  # torch repeat_interleave
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    logits = np.where(mask[:, None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, v)


@pytest.mark.parametrize("hq,hkv,dk,dv", [(4, 4, 16, 16), (8, 2, 24, 16), (6, 1, 12, 20)])
def test_matches_reference_with_groups_and_unequal_widths(hq, hkv, dk, dv):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 7, hq, dk))
    k = jax.random.normal(keys[1], (2, 7, hkv, dk))
    v = jax.random.normal(keys[2], (2, 7, hkv, dv))
    out = attention(q, k, v, scale=dk**-0.5)
    pos = np.broadcast_to(np.arange(7), (2, 7))
    expected = reference_attention(*map(np.asarray, (q, k, v)), dk**-0.5, pos[:, None, :] <= pos[:, :, None])
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


def test_explicit_mask_hides_invalid_keys():
    q = jax.random.normal(jax.random.key(1), (1, 3, 2, 8))
    k = jax.random.normal(jax.random.key(2), (1, 5, 2, 8))
    v = jax.random.normal(jax.random.key(3), (1, 5, 2, 8))
    valid = jnp.array([[False, False, True, True, True]])
    mask = causal_mask(jnp.array([[2, 3, 4]]), jnp.arange(5)[None], valid)
    out = attention(q, k, v, scale=0.3, mask=mask)
    expected = reference_attention(*map(np.asarray, (q, k, v)), 0.3, np.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)
    # changing the masked keys changes nothing
    out2 = attention(q, k.at[:, :2].set(100.0), v.at[:, :2].set(-7.0), scale=0.3, mask=mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out2), atol=1e-6)


def test_cudnn_on_cpu_is_a_clear_error():
    x = jnp.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        attention(x, x, x, scale=1.0, impl="cudnn")
