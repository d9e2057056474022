"""Pallas decode kernels against their jnp reference: TPU kernel in interpret mode on CPU, the Mosaic GPU
kernel and the model's pallas path on a GPU (run there with JAX_PLATFORMS=cuda)."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import latent_decode_inputs as inputs
from helpers import on_gpu, run_interpreted_cases, sharded_over
from mlra_jax.experiments.tiny import tiny_model
from mlra_jax.pallas_kernels.latent_decode_common import combine
from mlra_jax.pallas_kernels.latent_decode_reference import gather_pages, reference
from mlra_jax.pallas_kernels.latent_decode_tpu import latent_decode_tpu

from mlra_jax.attention.latent_kernels import ranges_from_mask
from mlra_jax.decode.generator import Generator, left_pad
from mlra_jax.model import init_model

# Widths of the paper's per-device decode: MLRA-4 (64 heads, 128 latent), GLA-2 (32, 256), MLA (64, 512).
SHAPES = [(64, 64, 128, 1), (32, 64, 256, 1), (64, 64, 512, 1), (64, 64, 128, 2)]


@pytest.mark.parametrize("heads,dr,r,blocks", SHAPES)
def test_tpu_kernel_in_interpret_mode(heads, dr, r, blocks):
    """Ragged ranges (one of a single token, one left-padded), 200 slots: not a multiple of the block."""
    args = inputs(heads, dr, r, blocks, 200)
    starts, ends = jnp.array([0, 37, 150]), jnp.array([200, 120, 151])
    scale = (dr + r) ** -0.5
    got = latent_decode_tpu(*args, starts, ends, scale=scale, block_kv=64, splits=3, interpret=True)
    want = reference(*args, starts, ends, scale=scale)
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def to_pages(k_rope, latent, page, seed=0):
    """The contiguous cache as a shuffled pool of pages (plus two unused zero pages) and its page table."""
    b, s = k_rope.shape[:2]
    count = b * s // page
    order = np.random.default_rng(seed).permutation(count + 2)[:count]  # pool slot of each contiguous page
    pool_k = (
        jnp.zeros((count + 2, page, *k_rope.shape[2:]), k_rope.dtype)
        .at[order]
        .set(k_rope.reshape(count, page, *k_rope.shape[2:]))
    )
    pool_l = (
        jnp.zeros((count + 2, page, *latent.shape[2:]), latent.dtype)
        .at[order]
        .set(latent.reshape(count, page, *latent.shape[2:]))
    )
    table = jnp.asarray(order.reshape(b, s // page), jnp.int32)
    np.testing.assert_array_equal(np.asarray(gather_pages(pool_l, table)), np.asarray(latent))
    return pool_k, pool_l, table


@pytest.mark.parametrize("heads,dr,r,blocks", SHAPES[:2])
def test_tpu_kernel_on_a_paged_cache(heads, dr, r, blocks):
    """Pages of 64 slots in shuffled order; ragged ranges that start and end inside pages."""
    q_rope, q_latent, k_rope, latent = inputs(heads, dr, r, blocks, 256)
    pool_k, pool_l, table = to_pages(k_rope, latent, 64)
    starts, ends = jnp.array([0, 37, 150]), jnp.array([256, 120, 151])
    scale = (dr + r) ** -0.5
    got = latent_decode_tpu(
        q_rope, q_latent, pool_k, pool_l, starts, ends, scale=scale, splits=2, page_table=table, interpret=True
    )
    want = reference(q_rope, q_latent, k_rope, latent, starts, ends, scale=scale)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_a_mismatched_page_table_is_named():
    q_rope, q_latent, k_rope, latent = inputs(8, 64, 128, 1, 128)
    pool_k, pool_l, table = to_pages(k_rope, latent, 64)
    ranges = jnp.zeros(3, jnp.int32), jnp.full(3, 128)
    with pytest.raises(ValueError, match="page table must be integer"):
        latent_decode_tpu(q_rope, q_latent, pool_k, pool_l, *ranges, scale=0.1, page_table=table[:2], interpret=True)
    with pytest.raises(ValueError, match="a paged cache is k_rope"):
        latent_decode_tpu(q_rope, q_latent, k_rope, pool_l, *ranges, scale=0.1, page_table=table, interpret=True)


@jax.default_matmul_precision("highest")  # full float32 on GPUs too
def test_split_kv_partials_combine_to_the_whole():
    q_rope, q_latent, k_rope, latent = inputs(8, 16, 32, 1, 96, jnp.float32)
    starts, ends = jnp.array([0, 10, 50]), jnp.array([96, 70, 51])
    whole = reference(q_rope, q_latent, k_rope, latent, starts, ends, scale=0.2)
    cuts = jnp.array([0, 30, 60, 96])
    parts, lse = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        lo, hi = jnp.maximum(starts, a), jnp.minimum(ends, b)
        parts.append(reference(q_rope, q_latent, k_rope, latent, lo, jnp.maximum(hi, lo), scale=0.2))
        logits = (jnp.einsum("bnhr,bsnr->bnhs", q_latent, latent) + jnp.einsum("bnhk,bsk->bnhs", q_rope, k_rope)) * 0.2
        slots = jnp.arange(96)
        valid = (slots[None] >= lo[:, None]) & (slots[None] < hi[:, None])
        lse.append(jax.nn.logsumexp(jnp.where(valid[:, None, None], logits, -jnp.inf), axis=-1) / np.log(2))
    merged = combine(jnp.nan_to_num(jnp.stack(parts, axis=2)), jnp.stack(lse, axis=2), jnp.float32)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(whole), atol=1e-5)
    single = combine(jnp.stack(parts[1:2], axis=2), jnp.stack(lse[1:2], axis=2), jnp.bfloat16)  # one split: a cast
    np.testing.assert_array_equal(np.asarray(single, np.float32), np.asarray(parts[1].astype(jnp.bfloat16), np.float32))


def test_the_combines_heads_per_cta():
    """A CTA merges up to 8 heads' rows where the CTAs still cover the SMs: MLA's 128 heads at batch 32 (four
    128-wide columns), MLRA-4's 128 at batch 64; at batch 1 (24 heads) a row each; 12 heads take 4."""
    from mlra_jax.pallas_kernels.latent_decode_gpu import combine_heads

    assert combine_heads((32, 1, 2, 128, 512), 128, 132) == 8 and combine_heads((64, 1, 2, 128, 128), 128, 132) == 8
    assert combine_heads((1, 4, 32, 64, 128), 24, 132) == 1  # 96 rows of 128 values
    assert combine_heads((2, 2, 5, 16, 256), 12, 1) == 4 and combine_heads((2, 2, 5, 16, 256), 12, 24) == 4
    assert combine_heads((1, 1, 2, 128, 512), 128, 132) == 2


def test_mosaic_gpu_combine_in_interpret_mode():
    """The split-KV merge kernel against combine: padded heads, an empty split, a head whose splits are all empty;
    4 heads' rows per CTA (on 24 SMs; test_latent_kernel_merge_times_each_heads_per_cta_against_its_bytes runs 1,
    2, 4 and 8)."""
    from mlra_jax.pallas_kernels.latent_decode_gpu import COMBINE_COLUMNS, combine_gpu

    keys = jax.random.split(jax.random.key(3), 2)
    out = jax.random.normal(keys[0], (2, 2, 5, 16, 2 * COMBINE_COLUMNS), jnp.bfloat16)
    lse = (jax.random.normal(keys[1], (2, 2, 5, 16)) * 4).at[0, 1, 2].set(-jnp.inf).at[1, 0, :, 3].set(-jnp.inf)
    got = combine_gpu(out, lse, jnp.bfloat16, heads=12, sms=24, interpret=True)
    want = combine(out, lse, jnp.bfloat16)[:, :, :12]
    assert got.shape == want.shape == (2, 2, 12, 2 * COMBINE_COLUMNS) and not np.asarray(got[1, 0, 3], np.float32).any()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_the_mosaic_gpu_kernel_in_interpret_mode():
    """latent_decode_kernel_cases.py: the kernel in each CTA layout against the reference, in Pallas's GPU
    interpreter (a pytest process of its own: helpers.run_interpreted_cases)."""
    run_interpreted_cases(Path(__file__).with_name("latent_decode_kernel_cases.py"))


def test_the_heads_per_cta():
    """128 heads a CTA where CTAs of 64 would take more than one wave (MLRA-4's block at TP=4 and batch 128)."""
    from mlra_jax.pallas_kernels.latent_decode_gpu import heads_per_cta

    assert heads_per_cta(128, 128, programs=128, sms=132) == 128 and heads_per_cta(256, 256, 40, 132) == 128
    assert heads_per_cta(128, 128, programs=64, sms=132) == 64  # one wave of 64-head CTAs
    assert heads_per_cta(192, 128, 128) == heads_per_cta(128, 512, 128) == heads_per_cta(64, 128, 512) == 64
    assert heads_per_cta(128, 128, 1, requested=128) == 128 and heads_per_cta(128, 128, 512, requested=64) == 64
    with pytest.raises(ValueError, match="cta_heads=128"):
        heads_per_cta(128, 512, requested=128)
    with pytest.raises(ValueError, match="cta_heads=128"):
        heads_per_cta(192, 128, requested=128)


def test_the_kernels_split_plan_per_cta_layout():
    """The partials' shape [B, N, splits, heads, R] as the kernel plans it on 132 SMs: the 2.9B MLRA-4 at batch 1
    and 8K takes 32 splits of at least two 128-key tiles (one per warpgroup); MLRA-4's block at 128 heads and batch
    128 takes 128 heads a CTA and one split."""
    from mlra_jax.pallas_kernels.latent_decode_gpu import latent_partials_gpu

    def planned(b, n, h, r, slots):
        spec = jax.ShapeDtypeStruct
        args = (spec((b, n, h, 64), jnp.bfloat16), spec((b, n, h, r), jnp.bfloat16), spec((b, slots, 64), jnp.bfloat16))
        args += (spec((b, slots, n, r), jnp.bfloat16), spec((b,), jnp.int32), spec((b,), jnp.int32))
        return jax.eval_shape(lambda *x: latent_partials_gpu(*x, scale=0.1), *args)[0].shape

    assert planned(1, 4, 24, 128, 8192) == (1, 4, 32, 24, 128)
    assert planned(128, 1, 128, 128, 1024) == (128, 1, 1, 128, 128)


def test_ranges_from_mask():
    mask = jnp.array([[[False, True, True, False]], [[True, True, True, True]]])
    starts, ends = ranges_from_mask(mask)
    assert starts.tolist() == [1, 0] and ends.tolist() == [3, 4]


def test_pallas_impl_needs_an_accelerator():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU error")
    model = init_model(tiny_model("mlra4", n_layer=1, vocab_size=64, attention_impl="pallas"))
    with pytest.raises(ValueError, match="attention_impl='pallas' needs a GPU or TPU"):
        Generator(model, max_len=128).generate([[1, 2]])


@on_gpu
@pytest.mark.parametrize(
    "heads,dr,r,blocks",
    SHAPES + [(8, 64, 128, 1), (96, 64, 128, 1), (12, 64, 256, 1), (128, 64, 128, 1), (256, 64, 256, 2)],
)
def test_mosaic_gpu_kernel(heads, dr, r, blocks):
    from mlra_jax.pallas_kernels.latent_decode_gpu import latent_decode_gpu

    args = inputs(heads, dr, r, blocks, 4104)  # 4104 = 64 * 64 + 8: a partial last tile
    starts, ends = jnp.array([0, 37, 2050]), jnp.array([4104, 1200, 2051])
    want = reference(*args, starts, ends, scale=(dr + r) ** -0.5)
    for cta_heads in (None, 128) if heads % 128 == 0 and r <= 256 else (None,):  # "heads" mode where it runs
        for splits in (1, 7, None):
            got = latent_decode_gpu(*args, starts, ends, scale=(dr + r) ** -0.5, splits=splits, cta_heads=cta_heads)
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


@on_gpu
@pytest.mark.parametrize("heads,dr,r,blocks", SHAPES + [(128, 64, 128, 1)])
@pytest.mark.parametrize("page", [64, 256])
def test_mosaic_gpu_kernel_on_a_paged_cache(heads, dr, r, blocks, page):
    from mlra_jax.pallas_kernels.latent_decode_gpu import latent_decode_gpu

    q_rope, q_latent, k_rope, latent = inputs(heads, dr, r, blocks, 4096)
    pool_k, pool_l, table = to_pages(k_rope, latent, page)
    starts, ends = jnp.array([0, 37, 2050]), jnp.array([4096, 1200, 2051])
    scale = (dr + r) ** -0.5
    want = reference(q_rope, q_latent, k_rope, latent, starts, ends, scale=scale)
    for splits in (1, None):
        got = latent_decode_gpu(
            q_rope,
            q_latent,
            pool_k,
            pool_l,
            starts,
            ends,
            scale=scale,
            splits=splits,
            page_table=table,
            cta_heads=128 if heads == 128 else None,
        )
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


@on_gpu
@pytest.mark.parametrize("variant", ["mla", "gla2", "mlra4"])
def test_model_decode_with_the_pallas_kernel(variant):
    cfg = tiny_model(
        variant,
        n_layer=2,
        n_head=4,
        n_embd=256,
        vocab_size=256,
        q_lora_rank=128,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        compute_dtype="bfloat16",
        output_init="normal",
    )
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    outputs = {}
    for impl in ("xla", "pallas"):
        model = init_model(dataclasses.replace(cfg, attention_impl=impl), seed=0)
        generator = Generator(model, max_len=64)
        logits, state = generator.prefill(prompts)
        steps = [np.asarray(generator.step(jnp.array([[9], [10]]), state)[0], np.float32)]
        outputs[impl] = steps[0]
    np.testing.assert_allclose(outputs["pallas"], outputs["xla"], atol=0.05 * np.abs(outputs["xla"]).max())


@pytest.mark.slow
@pytest.mark.parametrize("variant,mesh_shape", [("mla", (8, 1)), ("mlra4", (2, 4)), ("gla2", (4, 2))])
def test_pallas_decode_under_data_and_tensor_parallelism(monkeypatch, variant, mesh_shape):
    """The TPU kernel in Pallas interpret mode under a (data, tensor) mesh of 8 CPU devices: one shard_map with
    every mesh axis manual around it (interpret mode's callbacks, like the GPU compiler, need that), each
    device's own sequences, no gathered cache; the serving path's step equals the unsharded XLA step."""
    if jax.device_count() < 8 or jax.default_backend() != "cpu":
        pytest.skip("runs on the 8 virtual CPU devices of the test suite")
    import mlra_jax.attention.latent_kernels as kernels
    from mlra_jax.config import MeshConfig
    from mlra_jax.sharding import make_mesh

    calls = []

    def kernel(*args, scale):
        calls.append(args[0].shape[0])  # the batch each call sees
        return latent_decode_tpu(*args, scale=scale, interpret=True)

    monkeypatch.setattr(kernels, "kernel_for_backend", lambda: kernel)
    cfg = tiny_model(variant, n_layer=1, n_head=8, vocab_size=64, output_init="normal")
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11], [12, 13], [14, 15, 16], [17]]
    model = init_model(cfg, seed=0)
    unsharded = Generator(model, max_len=16)
    _, state = unsharded.prefill(prompts)
    want = np.asarray(unsharded.step(jnp.arange(8)[:, None], state)[0])[:, 0]

    mesh = make_mesh(MeshConfig(data=mesh_shape[0], tensor=mesh_shape[1]))
    model = init_model(dataclasses.replace(cfg, attention_impl="pallas"), seed=0)
    model = sharded_over(model, mesh)
    serving = Generator(model, max_len=40, mesh=mesh, min_bucket=40).serving  # 40 slots: no other size is 40
    tokens, starts = left_pad(prompts)
    _, session = serving.prefill(tokens, starts, 1, 40)
    got = np.asarray(serving.step(jnp.arange(8)[:, None], session))
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert calls == [8 // mesh_shape[0]]  # traced once, on one data shard's sequences
    with jax.set_mesh(mesh):
        step = serving.compiled(True, (8, 1))
        hlo = step.lower(serving.weights, jnp.arange(8)[:, None], session.caches).compile().as_text()
    gathered = [
        line
        for line in hlo.splitlines()
        if re.search(r"= \S+ all-gather\(", line) and re.search(r"\[[\d,]*\b40\b[\d,]*\]", line.split("all-gather(")[0])
    ]
    assert session.caches.max_len == 40 and not gathered, gathered  # nothing with the cache's slots is gathered


def test_the_gpu_kernel_plans_for_the_devices_sm_count():
    """The split-KV plan reads the GPU's SM count: MLA at batch 1 over 8K slots runs 64 splits in two halves on
    an H100 SXM's 132 SMs, and in one on an H100 PCIe's 114 (two halves would not fit at once)."""
    from mlra_jax.pallas_kernels.latent_decode_gpu import DEFAULT_SMS, launch_plan, sm_count

    class PCIe:
        platform, core_count = "gpu", 114

    assert sm_count(PCIe()) == 114 and sm_count(jax.devices("cpu")[0]) == DEFAULT_SMS == 132
    assert launch_plan(1, 8192, 128, True, False, 132) == (64, 2)
    assert launch_plan(1, 8192, 128, True, False, sm_count(PCIe())) == (64, 1)
    assert launch_plan(8, 8192, 128, True, False, 132, splits=8) == (8, 2)  # splits as given
    assert launch_plan(8, 8192, 128, True, False, 114, splits=8) == (8, 1)
