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


def check(shape, dtype, tolerance, branches=None, block_kv=64, **schedule):
    args = inputs(*shape, dtype)
    scale = (shape[4] + shape[5]) ** -0.5
    out, lse = mlra_attention_gpu(*args, scale=scale, branches=branches, block_kv=block_kv, interpret=True, **schedule)
    want_out, want_lse = mlra_attention_reference(*args, scale=scale)
    b, t, n, h, r, _ = shape
    assert out.shape == (b, t, n, h, r) and out.dtype == dtype and lse.shape == (b, n, h, t)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), **tolerance)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


def test_plan_shares_the_rope_scores_within_the_register_budget():
    assert plan(4, 128, 64, block_kv=64) == (2, 3)  # MLRA-4 2.9B: two branches per CTA, three 40 KiB key stages
    assert plan(4, 64, 64, block_kv=64)[0] == 4 and plan(2, 128, 64, block_kv=64)[0] == 2
    assert plan(3, 128, 64)[0] == 1
    assert plan(4, 128, 64) == (1, 3)  # 128-key stages (the default): two branches' leave room for one only


def test_float32_default_schedule():
    """The defaults: one branch, 128-key tiles, each warpgroup's P V overlapping its next softmax, no ping-pong."""
    args = inputs(1, 256, 2, 1, 64, 64, jnp.float32)
    out, lse = mlra_attention_gpu(*args, scale=0.125, interpret=True)
    want_out, want_lse = mlra_attention_reference(*args, scale=0.125)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_float32_ping_pong(overlap):
    """The two warpgroups' turns, with and without the overlap: 64-key tiles, so that the first warpgroup takes
    its turns through the tiles past its diagonal."""
    check((1, 256, 1, 1, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), 1, pingpong=True, overlap=overlap)


def test_float32_ping_pong_row_sum_after_the_turn(monkeypatch):
    import mlra_jax.pallas_kernels.mlra_attention_gpu as kernel

    monkeypatch.setattr(kernel, "SUM_BEFORE_TURN", False)
    jax.clear_caches()
    check((1, 256, 2, 1, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), None, pingpong=True)
    jax.clear_caches()


def test_the_overlap_takes_one_branch():
    with pytest.raises(ValueError, match="overlap=True takes one branch"):
        check((1, 128, 2, 1, 64, 64), jnp.float32, {}, 2, overlap=True)


def test_float32_four_branches_over_one_rope_score():
    """4 blocks in one CTA, 4 key tiles through 3 stages (one slot refilled), both warpgroups' causal tails."""
    check((1, 256, 4, 1, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5))


def test_float32_128_key_tiles():
    """Keys in tiles of 128: both warpgroups read every tile of the CTA, the diagonal one masked for both."""
    check((1, 256, 2, 1, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), block_kv=128)


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


def test_the_benchmark_times_the_kernel_beside_cudnn_on_the_same_inputs(monkeypatch):
    """`mlra bench attention_kernels --kernels=mlra` on an MLRA-2 layer (two head groups, each two branches sharing
    the group's RoPE queries) on CPU: the kernel in interpret mode, XLA's attention standing in for cuDNN on the
    absorbed layout, a fixed timer. The rows carry the layer's model FLOPs, errors of a correct kernel against
    the reference and against the cuDNN stand-in, and the speed-up over that call."""
    import dataclasses

    from mlra_jax.experiments import get_experiment

    from mlra_jax.attention.core import attention
    from mlra_jax.benchmarks import attention_kernels as bench

    times = iter([4e-3, 2e-3, 1e-3])  # the cuDNN call, then ours: two branches per CTA, then one with 128-key tiles

    def timed(fn, repeats):
        jax.block_until_ready(fn())
        return {"time_s": next(times)}

    monkeypatch.setattr(bench, "profiled_time", timed)
    tilings = ((None, 64, True, False), (2, 64, True, False), (1, 128, False, True))  # the plan's 2 taken once
    monkeypatch.setattr(bench, "MLRA_TILINGS", tilings)
    monkeypatch.setattr(bench, "cudnn_attention", lambda q, k, v, scale: attention(q, k, v, scale=scale, impl="xla"))
    model = tiny_model("mlra2", n_head=2, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64)
    experiment = dataclasses.replace(get_experiment("mlra2_tiny"), model=model)
    assert bench.mlra_layout(model) == {"groups": 2, "blocks": 2, "heads": 1, "rank": 64, "rope": 64}
    rows = bench.mlra_rows(experiment, batch=1, repeats=1, interpret=True)
    assert [(r["kernel"], r.get("tiling")) for r in rows] == [
        ("cudnn", None),
        ("mlra_mosaic_gpu", {"branches": 2, "block_kv": 64, "stages": 4, "pingpong": True, "overlap": False}),
        ("mlra_mosaic_gpu", {"branches": 1, "block_kv": 128, "stages": 4, "pingpong": False, "overlap": True}),
    ]
    flops = bench.model_flops(1, 4, 128, 128, 64, causal=True, backward=False)  # 2 branches x 2 heads, 64 + 64 / 64
    for row, seconds in zip(rows, (4e-3, 2e-3, 1e-3)):
        assert (row["heads"], row["dk"], row["dv"], row["passes"], row["mask"]) == (4, 128, 64, "forward", "causal")
        assert row["model_tflops_per_s"] == pytest.approx(flops / seconds / 1e12)
        assert row["relative_error_vs_reference"] < 1e-2 and row["max_abs_error_vs_reference"] < 2e-2
    for row, speedup in zip(rows[1:], (2.0, 4.0)):
        assert row["finite"] and row["speedup_vs_cudnn"] == pytest.approx(speedup) and row["cudnn_time_s"] == 4e-3
        assert row["max_abs_error_vs_cudnn"] < 2e-2 and row["lse_max_abs_error_vs_reference"] < 1e-4
