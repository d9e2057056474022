"""GQA's decode kernel (pallas_kernels.gqa_decode_gpu, Pallas Triton) against its jnp reference and the model's XLA
decode path: in Pallas interpret mode on CPU (float32 and bf16, ragged ranges, a cache that is not a multiple of
the tile, KV splits, padded and blocked query heads; one-device and data x tensor parallel decode steps), lowered
for CUDA on the CPU at the TP=4 deployment's per-device shape, and compiled on a GPU at that shape."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import on_gpu, sharded_over
from mlra_jax.experiments.tiny import tiny_model
from mlra_jax.pallas_kernels import gqa_decode_gpu as kernels
from mlra_jax.pallas_kernels.gqa_decode_gpu import Tiling, gqa_decode_gpu, gqa_decode_reference

from mlra_jax.attention import gqa_kernel
from mlra_jax.decode.generator import Generator, left_pad
from mlra_jax.model import init_model
from mlra_jax.tensor_parallel import UnitPlan

BF16 = jnp.bfloat16
# The per-device shape of DeepSeek-V3's GQA layer at TP=4: batch 64, 4 KV heads of 8 query heads, head dim 128
REAL = dict(batch=64, kv_heads=4, groups=8, head_dim=128)


def assert_close(got, want, dtype):
    """Equal up to about one rounding of `dtype` of the largest value (the kernel sums in another order and rounds
    unnormalized probabilities)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    ulp = 2.0**-7 if dtype == BF16 else 2e-6
    np.testing.assert_allclose(got, want, rtol=ulp, atol=2 * ulp * np.abs(want).max())


def inputs(batch, slots, kv_heads, groups, head_dim, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (batch, kv_heads, groups, head_dim), dtype),
        jax.random.normal(keys[1], (batch, slots, kv_heads, head_dim), dtype),
        jax.random.normal(keys[2], (batch, slots, kv_heads, head_dim), dtype),
    )


# (slots, KV heads, query heads per KV head, head dim, tiling, dtype): one split writing the output itself; splits
# merged, with empty ones (the single-token range); 200 slots, not a multiple of the tile; G=3 padded to 16 rows;
# G=72 in two head blocks of 64 rows
CASES = [
    (200, 2, 4, 32, Tiling(block_s=64, splits=1), jnp.float32),
    (200, 2, 4, 32, Tiling(block_s=64, splits=1), BF16),
    (200, 2, 4, 32, Tiling(block_s=32, splits=3), jnp.float32),
    (200, 2, 4, 32, Tiling(block_s=32, splits=3), BF16),
    (96, 1, 3, 16, Tiling(block_s=16, splits=2), BF16),
    (64, 1, 72, 16, Tiling(block_s=16, splits=1), BF16),
]


@pytest.mark.parametrize("slots,kv_heads,groups,head_dim,tiling,dtype", CASES, ids=str)
def test_kernel_in_interpret_mode_matches_the_reference(slots, kv_heads, groups, head_dim, tiling, dtype):
    q, k, v = inputs(3, slots, kv_heads, groups, head_dim, dtype, seed=slots + groups)
    starts = jnp.array([0, 17, slots - 50])  # ragged: a full cache, a left-padded range, a single token
    ends = jnp.array([slots, slots - 20, slots - 49])
    scale = head_dim**-0.5
    got = gqa_decode_gpu(q, k, v, starts, ends, scale=scale, tiling=tiling, interpret=True)
    assert got.dtype == dtype
    assert_close(got, gqa_decode_reference(q, k, v, starts, ends, scale=scale), dtype)


def test_the_split_plan_and_the_head_rows():
    assert kernels.head_rows(8) == (16, 1) and kernels.head_rows(32) == (32, 1) and kernels.head_rows(72) == (64, 2)
    assert kernels.choose_splits(64 * 4, 8192, 64, 132) == 1  # batch 64 x 4 KV heads fill an H100's SMs
    assert kernels.choose_splits(64, 8192, 64, 132) == 5  # TP=8's one KV head per device: about two per SM
    assert kernels.choose_splits(1, 128, 64, 132) == 1  # at least 4 tiles per split
    with pytest.raises(ValueError, match="power-of-two head dim"):
        gqa_decode_gpu(*inputs(1, 16, 1, 2, 24, BF16), jnp.zeros(1), jnp.ones(1), scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="power-of-two block_s"):
        Tiling(block_s=48)


def test_kernel_lowers_for_cuda_at_the_tp4_deployments_shape():
    """The kernel at batch 64, 8K slots, 4 KV heads of 8 query heads, head dim 128, bf16 (one split and four)
    lowers to a Triton call for CUDA on this CPU (Triton compiles it on the GPU)."""
    b, kv, g, d = REAL.values()
    spec = jax.ShapeDtypeStruct
    args = (
        spec((b, kv, g, d), BF16),
        spec((b, 8192, kv, d), BF16),
        spec((b, 8192, kv, d), BF16),
        spec((b,), jnp.int32),
        spec((b,), jnp.int32),
    )
    for tiling in (Tiling(), Tiling(splits=4)):
        lowered = (
            jax.jit(lambda *a, tiling=tiling: gqa_decode_gpu(*a, scale=d**-0.5, tiling=tiling))
            .trace(*args)
            .lower(lowering_platforms=("cuda",))
        )
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_head_table_gathers_each_devices_heads_by_the_kv_head_they_read():
    """24 query heads on 6 KV heads at TP=4 (the aligned plan): device 0's heads 0-3 read its slot 0, 4-5 slot 1;
    device 1's heads 6-7 read slot 0, 8-11 slot 1. Split plans need no table."""
    table = gqa_kernel.HeadTable.of(UnitPlan(6, 4, 24), 2)
    assert table.rows == 4
    np.testing.assert_array_equal(table.gather[0], [[0, 1, 2, 3], [4, 5, 4, 4]])
    np.testing.assert_array_equal(table.gather[1], [[0, 1, 0, 0], [2, 3, 4, 5]])
    np.testing.assert_array_equal(table.back[0], [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(table.back[1], [0, 1, 4, 5, 6, 7])
    split = gqa_kernel.HeadTable.of(UnitPlan(16, 4, 128), 4)
    assert split.gather is None and split.rows == 8
    assert gqa_kernel.HeadTable.of(UnitPlan(4, 1, 8), 4).gather is None


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]  # ragged: left-padded to different starts


def decode_logits(cfg, impl, max_len=21):
    """The logits of two decode steps after prefilling PROMPTS (a cache of max_len slots: 24, not a multiple of
    the kernel's tiles)."""
    model = init_model(dataclasses.replace(cfg, attention_impl=impl), seed=0)
    generator = Generator(model, max_len=max_len)
    _, state = generator.prefill(PROMPTS)
    first, state = generator.step(jnp.array([[20], [21], [22], [23]]), state)
    second, _ = generator.step(jnp.array([[24], [25], [26], [27]]), state)
    return np.asarray(first, np.float32), np.asarray(second, np.float32)


def counted_kernel(monkeypatch, calls):
    """The kernel in interpret mode with a tile of 16 slots, each call's q shape appended to `calls`."""
    monkeypatch.setattr(gqa_kernel, "INTERPRET", True)

    def run(q, k, v, starts, ends, *, scale):
        calls.append(q.shape)
        return gqa_decode_gpu(q, k, v, starts, ends, scale=scale, tiling=Tiling(block_s=16), interpret=True)

    monkeypatch.setattr(gqa_kernel, "kernel", lambda tiling=None: run)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_on_the_kernel_equals_the_xla_path(monkeypatch, dtype):
    """attention_impl="pallas" (the kernel in interpret mode standing in for the GPU's): a GQA model's decode steps
    over ragged left-padded sequences give the XLA path's logits; prefill stays on XLA."""
    cfg = tiny_model("gqa", n_layer=2, n_head=4, vocab_size=64, compute_dtype=dtype, output_init="normal")
    want = decode_logits(cfg, "xla")
    calls = []
    counted_kernel(monkeypatch, calls)
    got = decode_logits(cfg, "pallas")
    assert calls == [(4, 2, 2, 32)]  # traced once (the layers are scanned), on decode steps only
    tolerance = 2e-5 if dtype == "float32" else 0.02
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=tolerance * np.abs(w).max(), rtol=tolerance)


def test_auto_takes_the_kernel_where_it_runs_and_keeps_xla_elsewhere(monkeypatch):
    cfg = tiny_model("gqa", n_layer=1, n_head=4, vocab_size=64, compute_dtype="bfloat16", output_init="normal")
    assert gqa_kernel.AUTO_TAKES_GQA_KERNEL is True
    want = decode_logits(cfg, "auto")  # a CPU: XLA
    calls = []
    counted_kernel(monkeypatch, calls)  # the kernel in interpret mode stands in for an NVIDIA GPU's
    got = decode_logits(cfg, "auto")
    assert calls == [(4, 2, 2, 32)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=0.02 * np.abs(w).max(), rtol=0.02)
    monkeypatch.setattr(gqa_kernel, "AUTO_TAKES_GQA_KERNEL", False)
    decode_logits(cfg, "auto")
    assert len(calls) == 1


def test_pallas_keeps_xla_off_gpus_and_refuses_a_head_dim_it_cannot_take(monkeypatch):
    q = jax.ShapeDtypeStruct((2, 1, 4, 32), BF16)
    cache = jnp.zeros((2, 16, 2, 32), BF16)
    plan = UnitPlan(2, 1, 4)
    assert not gqa_kernel.use_kernel("pallas", q, cache, plan)  # a CPU: XLA, as before
    monkeypatch.setattr(gqa_kernel, "INTERPRET", True)
    assert gqa_kernel.use_kernel("pallas", q, cache, plan)
    assert not gqa_kernel.use_kernel("pallas", jax.ShapeDtypeStruct((2, 5, 4, 32), BF16), cache, plan)  # prefill
    assert not gqa_kernel.use_kernel("xla", q, cache, plan)
    monkeypatch.setattr(gqa_kernel, "AUTO_TAKES_GQA_KERNEL", True)
    assert gqa_kernel.use_kernel("auto", q, cache, plan)
    assert not gqa_kernel.use_kernel("auto", q, cache.astype(jnp.float32), plan)  # auto: 16-bit caches only
    with pytest.raises(ValueError, match="power-of-two head dim"):
        gqa_kernel.use_kernel("pallas", jax.ShapeDtypeStruct((2, 1, 4, 24), BF16), jnp.zeros((2, 16, 2, 24)), plan)


@pytest.mark.parametrize(
    "n_head,group_size,mesh_shape",
    [(8, 2, (2, 4)), (12, 2, (2, 4))],
    ids=["split", "aligned"],
)
def test_decode_under_data_and_tensor_parallelism(monkeypatch, n_head, group_size, mesh_shape):
    """On a (data, tensor) mesh of 8 CPU devices each device runs the kernel over the KV heads it stores with its
    own sequences and query heads: 4 KV heads split 1 per device, and 6 KV heads of 12 query heads at TP=4
    (aligned: each device stores the 2 KV heads its 3 query heads read, 2 + 1 or 1 + 2); the serving path's decode
    step gives the unsharded XLA path's logits."""
    if jax.device_count() < 8 or jax.default_backend() != "cpu":
        pytest.skip("runs on the 8 virtual CPU devices of the test suite")

    from mlra_jax.config import MeshConfig
    from mlra_jax.sharding import make_mesh

    cfg = tiny_model("gqa", n_layer=1, n_head=n_head, group_size=group_size, vocab_size=64, output_init="normal")
    want = decode_logits(cfg, "xla")
    calls = []
    counted_kernel(monkeypatch, calls)
    mesh = make_mesh(MeshConfig(data=mesh_shape[0], tensor=mesh_shape[1]))
    model = init_model(dataclasses.replace(cfg, attention_impl="pallas"), seed=0)
    model = sharded_over(model, mesh)
    serving = Generator(model, max_len=40, mesh=mesh, min_bucket=40).serving  # per-layer caches of 40 slots
    tokens, starts = left_pad(PROMPTS)
    _, session = serving.prefill(tokens, starts, 1, 40)
    got = np.asarray(serving.step(jnp.array([[20], [21], [22], [23]]), session), np.float32)
    local_heads = n_head // mesh_shape[1]
    assert len(calls) == 1 and calls[0][0] == 4 // mesh_shape[0]  # each device's own sequences
    assert calls[0][1] * calls[0][2] >= local_heads
    np.testing.assert_allclose(got, want[0][:, 0], atol=2e-5 * np.abs(want[0]).max(), rtol=2e-5)


@on_gpu
@pytest.mark.parametrize("slots", [1024, 8192])
@pytest.mark.parametrize("tiling", [Tiling(), Tiling(splits=4), Tiling(block_s=128, num_warps=8)], ids=str)
def test_the_compiled_kernel_at_the_tp4_deployments_shape(slots, tiling):
    """Compiled on the GPU at batch 64, 4 KV heads of 8 query heads, head dim 128, bf16, ragged ranges."""
    b, kv, g, d = REAL.values()
    q, k, v = inputs(b, slots, kv, g, d, BF16)
    starts = jnp.arange(b, dtype=jnp.int32) * 7 % 300
    ends = jnp.full((b,), slots, jnp.int32) - jnp.arange(b, dtype=jnp.int32) * 5 % 100
    got = gqa_decode_gpu(q, k, v, starts, ends, scale=d**-0.5, tiling=tiling)
    assert_close(got, gqa_decode_reference(q, k, v, starts, ends, scale=d**-0.5), BF16)


@on_gpu
def test_a_bf16_decode_step_on_the_compiled_kernel_equals_the_xla_path():
    cfg = tiny_model("gqa", n_layer=2, n_head=8, n_embd=256, head_dim=128, group_size=4, vocab_size=256)
    cfg = dataclasses.replace(cfg, compute_dtype="bfloat16", output_init="normal")
    want = decode_logits(cfg, "xla", max_len=300)
    got = decode_logits(cfg, "pallas", max_len=300)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=0.02 * np.abs(w).max(), rtol=0.02)


def test_the_benchmarks_gqa_impls_compute_the_same_attention(monkeypatch):
    """`mlra bench decode attention --variants=gqa4`: XLA's grouped product, the model's TP path on XLA
    (xla_as_stored) and the kernel (here in interpret mode, with a tiling given as the impl's fields) agree."""
    from mlra_jax.benchmarks import decode

    monkeypatch.setattr(gqa_kernel, "INTERPRET", True)
    case = decode.CASES["gqa4"]
    outputs = {}
    for impl in ("xla", "xla_as_stored", "gqa_kernel:16:4:2:2"):
        fn, args = decode.attention_fn(case, impl, batch=2, context=40)
        outputs[impl] = np.asarray(fn(*args), np.float32)
    assert decode.gqa_kernel_tiling("gqa_kernel:16:4:2:2") == Tiling(16, 4, 2, 2)
    for impl in ("xla_as_stored", "gqa_kernel:16:4:2:2"):
        np.testing.assert_allclose(outputs[impl], outputs["xla"], atol=0.02 * np.abs(outputs["xla"]).max())
