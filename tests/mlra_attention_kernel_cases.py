"""The MLRA training attention kernel (Mosaic GPU, forward) in Pallas's GPU interpret mode on CPU: against its jnp
reference (float32 and bfloat16, output and logsumexp) and against the library's training path
(latent_heads_attention, impl="xla") on a tiny MLRA-4 layer's own tensors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mlra_jax.experiments.tiny import tiny_model
from mlra_jax.pallas_kernels.mlra_attention_gpu import mlra_attention_gpu, mlra_attention_reference, plan

from mlra_jax.attention.latent import LatentAttention
from mlra_jax.model import init_model


def inputs(b, t, n, h, r, dr, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(keys[0], (b, t, n, h, r), dtype),
        jax.random.normal(keys[1], (b, t, h, dr), dtype),
        jax.random.normal(keys[2], (b, t, n, r), dtype),
        jax.random.normal(keys[3], (b, t, dr), dtype),
    )


def check(shape, dtype, tolerance, branches=None):
    args = inputs(*shape, dtype)
    scale = (shape[4] + shape[5]) ** -0.5
    out, lse = mlra_attention_gpu(*args, scale=scale, branches=branches, interpret=True)
    want_out, want_lse = mlra_attention_reference(*args, scale=scale)
    b, t, n, h, r, _ = shape
    assert out.shape == (b, t, n, h, r) and out.dtype == dtype and lse.shape == (b, n, h, t)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), **tolerance)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


def test_plan_shares_the_rope_scores_within_the_register_budget():
    assert plan(4, 128, 64) == (2, 3)  # MLRA-4 2.9B: two branches per CTA, three 40 KiB key stages
    assert plan(4, 64, 64)[0] == 4 and plan(2, 128, 64)[0] == 2 and plan(3, 128, 64)[0] == 1


def test_float32_four_branches_over_one_rope_score():
    """4 blocks in one CTA, 4 key tiles through 3 stages (one slot refilled), both warpgroups' causal tails."""
    check((1, 256, 4, 1, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5))


def test_bfloat16():
    check((1, 128, 2, 2, 64, 64), jnp.bfloat16, dict(rtol=1e-2, atol=1e-2))


@pytest.mark.slow
@pytest.mark.parametrize("branches", [None, 1])
def test_float32_at_mlra4_block_width(branches):
    """R = 128: two CTAs of 2 branches per head (or 4 of 1), one sequence, two heads."""
    check((1, 256, 4, 2, 128, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), branches)


def test_equals_the_library_training_path():
    """A tiny MLRA-4 layer (absorbed training, XLA attention): the kernel on the very tensors that
    latent_heads_attention receives in the model's forward gives its z."""
    cfg = tiny_model(
        "mlra4",
        n_layer=1,
        n_head=1,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        vocab_size=128,
        latent_form="absorbed",
        attention_impl="xla",
        scan_layers=False,
    )
    model = init_model(cfg)
    seen = []
    original = LatentAttention.latent_heads_attention

    def recording(self, q_latent, q_rope, latent, k_rope, mask):
        z = original(self, q_latent, q_rope, latent, k_rope, mask)
        seen.append((self.softmax_scale, q_latent, q_rope, latent, k_rope, mask, z))
        return z

    tokens = jax.random.randint(jax.random.key(1), (1, 128), 0, 128)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LatentAttention, "latent_heads_attention", recording)
        model(tokens)
    [(scale, q_latent, q_rope, latent, k_rope, mask, z)] = seen
    assert mask is None and q_latent.shape == (1, 128, 4, 1, 64) and latent.shape == (1, 128, 4, 64)
    # every block's queries carry the same RoPE part, and every block's key the same RoPE key: shared in the kernel
    np.testing.assert_array_equal(np.asarray(q_rope), np.broadcast_to(np.asarray(q_rope[:, :, :1]), q_rope.shape))
    out, _ = mlra_attention_gpu(q_latent, q_rope[:, :, 0], latent, k_rope[:, :, 0], scale=scale, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(z), rtol=1e-5, atol=1e-5)
