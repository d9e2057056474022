"""The MLRA training attention kernels (Mosaic GPU, forward and backward) in Pallas's GPU interpret mode on CPU:
against their jnp reference (float32 and bfloat16; output and logsumexp, the four inputs' gradients against
jax.vjp of the reference) and against the library's training path (latent_heads_attention, impl="xla") on a tiny
MLRA-4 layer's own tensors; the backward also lowers for the GPU on the CPU; a one-layer model trains through the
kernel (attention_impl="mlra_kernel") with the XLA attention's loss and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import on_gpu
from interpret_compiles import reuse_thread_compiles
from mlra_jax.experiments.tiny import tiny_model
from mlra_jax.pallas_kernels.mlra_attention_gpu import mlra_attention_gpu, mlra_attention_reference, plan
from mlra_jax.pallas_kernels.mlra_attention_gpu_backward import (
    BackwardTuning,
    mlra_attention,
    mlra_attention_backward,
)

from mlra_jax.attention.fused import kernels_chosen
from mlra_jax.attention.latent import LatentAttention
from mlra_jax.model import init_model
from mlra_jax.training.step import loss_fn

reuse_thread_compiles()  # one compile per simulated warpgroup program, not one per thread per CTA per call


def q_shape(shape, groups=1):
    """The query side's shape [G H, B, T, n, R] (head-major, as the kernels take it) of a case (b, t, n, h, r, dr)."""
    b, t, n, h, r = shape[:5]
    return groups * h, b, t, n, r


def inputs(b, t, n, h, r, dr, dtype, seed=0, groups=1):
    """q_latent [G H, B, T, n, R], q_rope [B, T, G H, Dr], latent [B, T, n G, R], k_rope [B, T, Dr]: n branches of
    h heads in each of `groups` head groups."""
    keys = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(keys[0], (groups * h, b, t, n, r), dtype),
        jax.random.normal(keys[1], (b, t, groups * h, dr), dtype),
        jax.random.normal(keys[2], (b, t, n * groups, r), dtype),
        jax.random.normal(keys[3], (b, t, dr), dtype),
    )


def check(shape, dtype, tolerance, branches=None, block_kv=64, groups=1, **schedule):
    args = inputs(*shape, dtype, groups=groups)
    scale = (shape[4] + shape[5]) ** -0.5
    out, lse = mlra_attention_gpu(
        *args, scale=scale, groups=groups, branches=branches, block_kv=block_kv, interpret=True, **schedule
    )
    want_out, want_lse = mlra_attention_reference(*args, scale=scale, groups=groups)
    b, t, n, h, r, _ = shape
    assert out.shape == (groups * h, b, t, n, r) and out.dtype == dtype and lse.shape == (b, n, groups * h, t)
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


@pytest.mark.parametrize("branches", [1, 2])
def test_float32_two_head_groups(branches):
    """MLRA-2's layout: two head groups of two heads, each head's two branches reading blocks c G + g (one branch per
    CTA, and both in one CTA over one RoPE score)."""
    check((1, 128, 2, 2, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), branches, groups=2)


@pytest.mark.parametrize("spec", ["default", "recomputed_ds"])
def test_backward_float32_two_head_groups(spec):
    """The backward with two head groups: each block's dK/dV CTA takes its own group's heads only, each dQ CTA its
    head's blocks (reading the stored dS of its block and head, or recomputing it); d k_rope sums over all four
    blocks, d q_rope over each head's two branches."""
    tuning = BackwardTuning.parse(spec)
    check_backward((1, 128, 2, 2, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), seed=9, groups=2, tuning=tuning)


@pytest.mark.slow
@pytest.mark.parametrize("branches", [None, 1])
def test_float32_at_mlra4_block_width(branches):
    """R = 128: CTAs of 2 branches per head (or of 1), one sequence of one query tile, two heads."""
    check((1, 128, 4, 2, 128, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), branches)


def reference_gradients(args, d_out, scale, groups=1):
    _, vjp = jax.vjp(lambda *x: mlra_attention_reference(*x, scale=scale, groups=groups)[0], *args)
    return vjp(d_out)


def check_backward(shape, dtype, tolerance, seed=0, tuning=BackwardTuning(), groups=1):
    """mlra_attention_backward (with `tuning`) on the forward kernel's output and logsumexp against jax.vjp of the
    reference."""
    args = inputs(*shape, dtype, seed=seed, groups=groups)
    d_out = jax.random.normal(jax.random.key(seed + 7), q_shape(shape, groups), dtype)
    scale = (shape[4] + shape[5]) ** -0.5
    out, lse = mlra_attention_gpu(*args, scale=scale, groups=groups, interpret=True)
    got = mlra_attention_backward(*args, out, lse, d_out, scale=scale, groups=groups, tuning=tuning, interpret=True)
    for g, w, x in zip(got, reference_gradients(args, d_out, scale, groups), args):
        assert g.shape == x.shape and g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tolerance)


def test_backward_float32_one_branch():
    """The default schedule (lockstep, skip_masked, prescale, stored_ds), two query heads: two CTAs of 128 keys (dK/dV:
    the first walks query tiles 3 and 2 for both heads, then its two diagonal tiles; the second starts at its
    diagonal, skipping the first query tiles; each head's first tile only observed by the second warpgroup) and of
    128 queries (dQ, reading the stored dS: four key tiles through two stages, two slots refilled; the first
    warpgroup's skipped tile)."""
    check_backward((1, 256, 1, 2, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize(
    "spec",
    [
        "recomputed_ds",  # the dQ kernel recomputes S, P, dP and dS
        "noskip+noprescale",  # the two diagonal query tiles masked for both dK/dV warpgroups (dS recomputed)
        "nolockstep",  # the dK/dV kernel's older walk: each head's tiles from the diagonal on (dS recomputed)
        "stages2",  # two slots in both kernels (every slot refilled)
    ],
)
def test_backward_float32_tunings(spec):
    """The backward's other schedules (BackwardTuning) against the reference on test_backward_float32_one_branch's
    shape (float32 has 3 stages to offer here; bf16 on the GPU 4 and 5)."""
    check_backward((1, 256, 1, 1, 64, 64), jnp.float32, dict(rtol=1e-5, atol=1e-5), tuning=BackwardTuning.parse(spec))


def test_backward_tunings_parse_and_name_their_limits():
    assert BackwardTuning() == BackwardTuning(skip_masked=True, prescale=True)
    assert BackwardTuning.parse("default") == BackwardTuning.parse("skip+prescale") == BackwardTuning()
    assert BackwardTuning.parse("noskip+dq_stages5") == BackwardTuning(dq_stages=5, skip_masked=False, stored_ds=False)
    assert BackwardTuning.parse("stages3+noprescale") == BackwardTuning(dkv_stages=3, dq_stages=3, prescale=False)
    assert BackwardTuning.parse("nolockstep") == BackwardTuning(lockstep=False, stored_ds=False)
    assert BackwardTuning.parse("recomputed_ds") == BackwardTuning(stored_ds=False) != BackwardTuning.parse("stored_ds")
    with pytest.raises(ValueError, match="stored_ds takes lockstep and skip_masked"):
        BackwardTuning.parse("nolockstep+stored_ds")
    with pytest.raises(ValueError, match="'pingpong' is none of"):
        BackwardTuning.parse("noskip+pingpong")
    args = inputs(1, 128, 1, 1, 64, 64, jnp.float32)
    rest = (args[0], jnp.zeros((1, 1, 1, 128)), args[0])
    limits = (("recomputed_ds+dq_stages4", "2 to 3 slots"), ("dq_stages3", "2 to 2 slots"), ("dkv_stages1", "=1: "))
    for spec, message in limits:
        with pytest.raises(ValueError, match=message):
            mlra_attention_backward(*args, *rest, scale=1.0, tuning=BackwardTuning.parse(spec), interpret=True)


def test_grad_through_the_public_entry_point():
    """jax.grad of a loss through mlra_attention (the forward kernel, then the backward's): two branches whose
    d k_rope and d q_rope sum over them, two query heads whose d latent and d k_rope sum over them (dK/dV: four
    query tiles through three stages)."""
    shape = (1, 128, 2, 2, 64, 64)
    args = inputs(*shape, jnp.float32, seed=3)
    weights = jax.random.normal(jax.random.key(4), q_shape(shape))
    scale = 0.1

    def loss(attend):
        return lambda *x: jnp.sum(jnp.sin(attend(*x)) * weights)

    got = jax.grad(loss(lambda *x: mlra_attention(*x, scale=scale, interpret=True)), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(loss(lambda *x: mlra_attention_reference(*x, scale=scale)[0]), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_the_backward_lowers_for_the_gpu():
    """The backward kernels (bf16, MLRA-4 2.9B's widths) lower to Mosaic GPU on the CPU: what interpret mode does
    not run (wgmma, register layouts, the accumulators' scopes) is at least well formed."""
    b, t, n, h, r, dr = 1, 512, 4, 2, 128, 64
    bf16, f32 = jnp.bfloat16, jnp.float32
    spec = jax.ShapeDtypeStruct
    q = (spec((h, b, t, n, r), bf16), spec((b, t, h, dr), bf16), spec((b, t, n, r), bf16), spec((b, t, dr), bf16))
    rest = (spec((h, b, t, n, r), bf16), spec((b, n, h, t), f32), spec((h, b, t, n, r), bf16))
    lowered = mlra_attention_backward.trace(*q, *rest, scale=0.07).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2


# the backward tunings checked on the GPU (the default, the older schedules, the dQ kernel's most slots), and the
# rest lowered on the CPU: the other switches' combinations with the fewest stages
GPU_TUNINGS = ("default", "recomputed_ds", "nolockstep", "nolockstep+noskip+noprescale", "recomputed_ds+dq_stages5")
LOWERED_TUNINGS = (*GPU_TUNINGS, "noskip+noprescale+stages2", "nolockstep+noskip+stages3", "noprescale+stages3")


@pytest.mark.parametrize("spec", LOWERED_TUNINGS)
def test_the_backward_tunings_lower_for_the_gpu(spec):
    """Every backward tuning lowers to Mosaic GPU on the CPU at MLRA-4 2.9B's layer (bf16, T = 2048, 4 blocks, 24
    heads, R = 128, Dr = 64; dq_stages5: the most slots SMEM takes there), through mlra_attention's custom_vjp
    (jax.grad of a loss: the forward and both backward kernels) as the benchmark calls it."""
    b, t, n, h, r, dr = 1, 2048, 4, 24, 128, 64
    bf16 = jnp.bfloat16
    spec_ = jax.ShapeDtypeStruct
    q = (spec_((h, b, t, n, r), bf16), spec_((b, t, h, dr), bf16), spec_((b, t, n, r), bf16), spec_((b, t, dr), bf16))

    def loss(*x):
        out = mlra_attention(*x[:4], scale=192**-0.5, tuning=spec)
        return jnp.sum(out.astype(jnp.float32) * x[4].astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    lowered = grad.trace(*q, spec_((h, b, t, n, r), bf16)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 3


def _grads(attend, *x):
    loss = lambda *y: jnp.sum(attend(*y[:4]).astype(jnp.float32) * y[4].astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*x)


@functools.cache
def _gpu_case():
    """The GPU tests' inputs (bf16, MLRA-4 2.9B's widths, two sequences of 512, 4 heads), the default tuning's
    gradients and the float32 reference's: computed once for all tunings."""
    shape = (2, 512, 4, 4, 128, 64)
    args = (*inputs(*shape, jnp.bfloat16, seed=11), jax.random.normal(jax.random.key(12), q_shape(shape), jnp.bfloat16))
    scale = (shape[4] + shape[5]) ** -0.5
    default = _grads(lambda *x: mlra_attention(*x, scale=scale), *args)
    with jax.default_matmul_precision("highest"):
        want = _grads(lambda *x: mlra_attention_reference(*x, scale=scale)[0], *(x.astype(jnp.float32) for x in args))
    return args, scale, default, want


@on_gpu
@pytest.mark.parametrize("spec", GPU_TUNINGS)
def test_the_backward_tunings_on_the_gpu(spec):
    """bf16 on the GPU: each tuning's gradients against the float32 reference's (relative L2 error under 1e-2, as
    the default's) and within bf16 rounding of the default's."""
    args, scale, default, want = _gpu_case()
    got = _grads(lambda *x: mlra_attention(*x, scale=scale, tuning=spec), *args)
    for g, d, w in zip(got, default, want):
        g, d, w = (np.asarray(x, np.float32) for x in (g, d, w))
        assert np.isfinite(g).all()
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-2
        np.testing.assert_allclose(g, d, atol=0.05 * np.abs(w).max(), rtol=0.05)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((1, 192, 1, 1, 64, 64), "multiple of 128 tokens"),
        ((1, 128, 1, 1, 96, 64), "multiples of 64"),
        ((1, 128, 1, 1, 192, 64), "R \\+ Dr <= 192"),
    ],
)
def test_the_backward_names_its_constraints(shape, message):
    args = inputs(*shape, jnp.float32)
    with pytest.raises(ValueError, match=message):
        mlra_attention_backward(
            *args, args[0], jnp.zeros(shape[:1] + shape[2:4] + shape[1:2]), args[0], scale=1.0, interpret=True
        )


@pytest.mark.slow
def test_backward_bfloat16_at_mlra4_block_width():
    """bf16 at R = 128: P and dS rounded to bf16 before their products, as on the GPU."""
    check_backward((1, 128, 2, 1, 128, 64), jnp.bfloat16, dict(rtol=5e-2, atol=5e-2))


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
    graphdef, state = nnx.split(model)

    def forward(state, tokens):  # jitted: the forward compiles as one program, not op by op
        nnx.merge(graphdef, state)(tokens)
        return [x for x in seen[-1][1:] if x is not None]  # the recorded tensors, out of the program

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LatentAttention, "latent_heads_attention", recording)
        q_latent, q_rope, latent, k_rope, z = jax.jit(forward)(state, tokens)
    [(scale, *_, mask, _)] = seen
    assert mask is None and q_latent.shape == (1, 128, 4, 1, 64) and latent.shape == (1, 128, 4, 64)
    # every block's queries carry the same RoPE part, and every block's key the same RoPE key: shared in the kernel
    np.testing.assert_array_equal(np.asarray(q_rope), np.broadcast_to(np.asarray(q_rope[:, :, :1]), q_rope.shape))
    heads_first = q_latent.transpose(3, 0, 1, 2, 4)  # [B, T, n, H, R] -> [H, B, T, n, R]
    out, _ = mlra_attention_gpu(heads_first, q_rope[:, :, 0], latent, k_rope[:, :, 0], scale=scale, interpret=True)
    np.testing.assert_allclose(np.asarray(out.transpose(1, 2, 3, 0, 4)), np.asarray(z), rtol=1e-5, atol=1e-5)


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
        seconds = next(times)
        kernels = {"short": seconds / 4, "long": seconds * 3 / 4}
        return {"time_s": seconds, "kernels_s": kernels, "timeline": [(k, 0.0, t * 1e6) for k, t in kernels.items()]}

    monkeypatch.setattr(bench, "profiled_time", timed)
    tilings = ((None, 64, True, False), (2, 64, True, False), (1, 128, False, True))  # the plan's 2 taken once
    monkeypatch.setattr(bench, "MLRA_TILINGS", tilings)
    monkeypatch.setattr(bench, "cudnn_attention", lambda q, k, v, scale: attention(q, k, v, scale=scale, impl="xla"))
    model = tiny_model("mlra2", n_head=2, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64)
    experiment = dataclasses.replace(get_experiment("mlra2_tiny"), model=model)
    assert bench.mlra_layout(model) == {"groups": 2, "blocks": 2, "heads": 1, "rank": 64, "rope": 64}
    rows = bench.mlra_rows(experiment, batch=1, repeats=1, interpret=True, backward=False)
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
        assert list(row["kernels_us"].items()) == [("long", seconds * 75e4), ("short", seconds * 25e4)]  # longest first
        assert row["timeline_us"] == [("short", seconds * 25e4), ("long", seconds * 75e4)]  # in the call's order
    for row, speedup in zip(rows[1:], (2.0, 4.0)):
        assert row["finite"] and row["speedup_vs_cudnn"] == pytest.approx(speedup) and row["cudnn_time_s"] == 4e-3
        assert row["max_abs_error_vs_cudnn"] < 2e-2 and row["lse_max_abs_error_vs_reference"] < 1e-4


@pytest.mark.slow
def test_the_benchmark_times_forward_and_backward_beside_cudnn(monkeypatch):
    """The benchmark's forward + backward rows (mlra_backward_rows) on CPU: cuDNN's gradients on the absorbed
    layout (XLA's attention standing in), ours through mlra_attention in interpret mode, a fixed timer; our row
    carries the four gradients' errors against the reference and against the cuDNN stand-in's."""
    from mlra_jax.attention.core import attention
    from mlra_jax.benchmarks import attention_kernels as bench

    times = iter([12e-3, 8e-3, 6e-3, 11e-3])  # cuDNN, ours with two backward tunings, cuDNN again

    def timed(fn, repeats):
        jax.block_until_ready(fn())
        seconds = next(times)
        kernels = {"short": seconds / 4, "long": seconds * 3 / 4}
        return {"time_s": seconds, "kernels_s": kernels, "timeline": [(k, 0.0, t * 1e6) for k, t in kernels.items()]}

    monkeypatch.setattr(bench, "profiled_time", timed)
    monkeypatch.setattr(bench, "cudnn_attention", lambda q, k, v, scale: attention(q, k, v, scale=scale, impl="xla"))
    args = inputs(1, 128, 2, 1, 64, 64, jnp.bfloat16)
    rows = bench.mlra_backward_rows(
        args, 0.1, 3e9, 1, {"passes": "forward"}, interpret=True, tunings=("default", "noskip+noprescale")
    )
    assert [(r["kernel"], r["passes"], r.get("tiling"), r.get("repeat")) for r in rows] == [
        ("cudnn", "forward+backward", None, None),
        ("mlra_mosaic_gpu", "forward+backward", {"backward_tile": 64, "backward": "default"}, None),
        ("mlra_mosaic_gpu", "forward+backward", {"backward_tile": 64, "backward": "noskip+noprescale"}, None),
        ("cudnn", "forward+backward", None, "after the backward tunings"),
    ]
    base, *ours, again = rows
    assert base["model_tflops_per_s"] == pytest.approx(3e9 / 12e-3 / 1e12) and base["time_s"] == 12e-3
    assert again["time_s"] == 11e-3
    for row, speedup in zip(ours, (1.5, 2.0)):
        assert row["finite"] and row["speedup_vs_cudnn"] == pytest.approx(speedup) and row["cudnn_time_s"] == 12e-3
        for name in ("d_q_latent", "d_q_rope", "d_latent", "d_k_rope"):  # bf16 gradients
            assert row[f"relative_error_{name}_vs_reference"] < 2e-2
            assert row[f"relative_error_{name}_vs_cudnn"] < 2e-2


def test_the_benchmark_names_a_misspelt_backward_tuning(capsys):
    from mlra_jax.benchmarks import attention_kernels as bench

    with pytest.raises(SystemExit):
        bench.main(["--kernels=mlra", "--mlra_backward=default,overlapp"])
    assert "'overlapp' is none of" in capsys.readouterr().err


def model_loss_and_grads(cfg, tokens):
    model = init_model(cfg, seed=0)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, t)))(params, tokens)


def kernel_and_xla(cfg, tokens):
    """The kernels the model chose with attention_impl="mlra_kernel", its (loss, grads) so, and XLA attention's."""
    import dataclasses

    with kernels_chosen() as chosen:
        through_kernel = model_loss_and_grads(dataclasses.replace(cfg, attention_impl="mlra_kernel"), tokens)
    return chosen, through_kernel, model_loss_and_grads(dataclasses.replace(cfg, attention_impl="xla"), tokens)


@pytest.mark.parametrize("variant, heads", [("mlra4", 1), pytest.param("mlra2", 2, marks=pytest.mark.slow)])
def test_the_model_trains_through_the_kernel(monkeypatch, variant, heads):
    """attention_impl="mlra_kernel" (the kernel in interpret mode standing in for the GPU's): a one-layer model's
    float32 loss and gradients equal the XLA attention's. MLRA-4 passes its tensors as they are (one head group);
    MLRA-2's two head groups are the kernel's `groups`, each with its two branches. The backward is the model's
    `mlra_backward` (MLRA-4 the default, stored dS; MLRA-2 recomputed)."""
    from mlra_jax.attention import mlra_kernel

    calls = []

    def interpreted(*args, scale, groups, tuning):
        calls.append((groups, tuning, *(x.shape for x in args)))
        return mlra_attention(*args, scale=scale, groups=groups, tuning=tuning, interpret=True)

    monkeypatch.setattr(mlra_kernel, "kernel", lambda: interpreted)
    monkeypatch.setattr(mlra_kernel, "device_problem", lambda dtype: None)
    cfg = tiny_model(
        variant,
        n_layer=1,
        n_head=heads,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        vocab_size=128,
        latent_form="absorbed",
        output_init="normal",
        scan_layers=False,
        mlra_backward="recomputed_ds" if variant == "mlra2" else "stored_ds",
    )
    tokens = jax.random.randint(jax.random.key(2), (1, 129), 0, 128)
    chosen, (loss, grads), (want_loss, want_grads) = kernel_and_xla(cfg, tokens)
    groups = 2 if variant == "mlra2" else 1
    assert chosen == {"mlra_kernel": 1}
    shapes = ((groups, 1, 128, 4 // groups, 64), (1, 128, groups, 64), (1, 128, 4, 64), (1, 128, 64))
    assert calls == [(groups, cfg.mlra_backward, *shapes)]
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), atol=1e-5 * scale + 1e-9, err_msg=jax.tree_util.keystr(path)
        )


@on_gpu
@pytest.mark.parametrize("variant", ["mlra4", "mlra2"])
def test_the_model_trains_through_the_kernel_on_the_gpu(variant):
    """bf16 on the GPU, two layers at the 2.9B block widths (R = 128, Dr = 64): the loss and gradients through the
    kernel (its head-major query side straight from W_UK's product and into W_UV's) are the XLA attention's
    within bf16 rounding."""
    cfg = tiny_model(
        variant,
        n_layer=2,
        n_head=8,
        n_embd=256,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        vocab_size=512,
        latent_form="absorbed",
        compute_dtype="bfloat16",
        scan_layers=False,
    )
    tokens = jax.random.randint(jax.random.key(6), (2, 513), 0, 512)
    chosen, (loss, grads), (want_loss, want_grads) = kernel_and_xla(cfg, tokens)
    assert set(chosen) == {"mlra_kernel"}
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-3)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= 3e-2 * np.linalg.norm(want) + 1e-6, jax.tree_util.keystr(path)
