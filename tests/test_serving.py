"""The serving path (decode.serving) against the model's own stacked-cache decoding: the same greedy
tokens for every variant across chunked prefill and cache buckets, one compile per bucket, caches
updated in place (no whole-cache copy in the compiled step), weights read in the compute dtype."""

import dataclasses
import functools
import gc
import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import on_gpu
from mlra_jax.experiments.tiny import tiny_model

import mlra_jax.attention.latent as latent_module
import mlra_jax.layers as layers_module
from mlra_jax.decode.generator import GenerationError, Generator, Sampling, left_pad, sample
from mlra_jax.decode.layouts import padded_mlp
from mlra_jax.decode.serving import ServingModel, capacity_bucket
from mlra_jax.kv_cache import init_cache, init_layer_caches
from mlra_jax.layers import MLP, ROW_COPIES, row_copies, single_row_axes, two_rows
from mlra_jax.model import init_model
from mlra_jax.variants import VARIANTS

PROMPTS = [[5, 17, 3], [9, 2, 44, 7, 1, 60, 8, 31, 12, 90, 4], [70, 6, 21, 15, 99, 3]]  # 3, 11 and 6 tokens
NEW_TOKENS = 12  # 12 prompt slots (3 chunks of 4) + 12 new: capacities 16 then 24
TWO_LAYERS = ("gqa", "mlra4")  # the others decode one layer (the per-layer plumbing is the same; the suite's time)


def stacked_greedy(generator, prompts, steps):
    """Greedy tokens from the model's forward_cached over a stacked cache (every position's logits)."""
    logits, state = generator.prefill(prompts)
    tokens = []
    for _ in range(steps):
        next_tokens = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        tokens.append(np.asarray(next_tokens))
        logits, state = generator.step(next_tokens[:, None], state)
    return np.stack(tokens, axis=1).tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_serving_decodes_the_same_tokens_as_the_stacked_cache(variant):
    n_layer = 2 if variant in TWO_LAYERS else 1
    # an MLP width of 200: serving pads it to 256 (padded_mlp)
    model = init_model(
        tiny_model(variant, n_layer=n_layer, vocab_size=128, output_init="normal", intermediate_size=200), seed=0
    )
    generator = Generator(model, max_len=32, prefill_chunk=4, min_bucket=16)
    layer = generator.serving.weights["layers"][0]
    out_major = generator.serving.rows  # the batch-1 row kernels' layout ([out, in]), taken on GPUs
    down, gate_up = layer["mlp"]["down_proj"], layer["mlp"]["gate_up"]
    assert (down.shape[-1] if out_major else down.shape[0]) == 256
    assert (gate_up.shape[:2] if out_major else gate_up.shape[-2:]) == (2, 256)
    if "kv_up" in layer["attn"]:  # the latent family: head-major W_UK and W_UV, x's projections merged
        attn = model.blocks.attn
        blocks, rank, heads, width = attn.kv_up.shape[1:]
        assert layer["attn"]["kv_up"].shape == (2, blocks, heads, rank, width // 2)
        merged = attn.q_down.shape[-1] + blocks * rank + attn.k_rope_proj.shape[-1]
        d = attn.q_down.shape[1]
        assert layer["attn"]["x_proj"].shape == ((merged, d) if out_major else (d, merged))
        assert "q_down" not in layer["attn"]
    got = generator.generate(PROMPTS, Sampling(max_new_tokens=NEW_TOKENS, eos_id=None))
    assert got == stacked_greedy(generator, PROMPTS, NEW_TOKENS)
    # prefill: 3 chunks of 4 tokens, one compile; decode calls of 8 steps (STEPS_PER_CALL) and of the rest, in the
    # bucket that holds them all (24): one compile each
    assert dict(generator.serving.traces) == {("prefill", 4, 16): 1, ("step", 1, 24): 2}


def test_sampled_steps_draw_what_separate_sampling_draws():
    """generate samples inside each decode step's call; the tokens are those of a step, then a draw with the
    next key of the seed's chain."""
    model = init_model(tiny_model("mlra4", vocab_size=128, output_init="normal"), seed=0)
    generator = Generator(model, max_len=32, prefill_chunk=4, min_bucket=16)
    sampling = Sampling(max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.9, eos_id=None, seed=3)
    got = generator.generate(PROMPTS, sampling)
    tokens, starts = left_pad(PROMPTS)
    logits, session = generator.serving.prefill(tokens, starts, 6, 32)
    key, drawn = jax.random.key(3), []
    for _ in range(6):
        key, draw_key = jax.random.split(key)
        drawn.append(sample(logits, draw_key, 0.9, 20, 0.9))
        logits = generator.serving.step(drawn[-1][:, None], session)
    assert got == np.stack(drawn, axis=1).tolist()
    assert generator.sampler(sampling) is generator.sampler(Sampling(temperature=0.9, top_k=20, top_p=0.9))


def test_calls_of_several_steps_generate_the_tokens_of_single_steps():
    """generate's decode calls of steps_per_call steps (ServingModel.sampled_steps) give the tokens of one step per
    call, with sampling, an EOS that ends rows mid-call and a stop callback; fewer than 1 is refused."""
    model = init_model(tiny_model("mla", n_layer=1, vocab_size=128, output_init="normal"), seed=0)
    single = Generator(model, max_len=32, prefill_chunk=4, min_bucket=16, steps_per_call=1)
    sampling = Sampling(max_new_tokens=9, temperature=0.8, top_k=30, eos_id=None, seed=5)
    reference = single.generate(PROMPTS, sampling)
    eos = reference[0][3]  # ends row 0 (and any row that draws it) part way through a call
    stop = lambda row, tokens: row == 2 and len(tokens) == 5
    with_eos = dataclasses.replace(sampling, eos_id=eos)
    for steps in (3, 8):
        several = Generator(model, max_len=32, prefill_chunk=4, min_bucket=16, steps_per_call=steps)
        assert several.generate(PROMPTS, sampling) == reference
        assert several.generate(PROMPTS, with_eos, stop) == single.generate(PROMPTS, with_eos, stop)
    assert len(single.generate(PROMPTS, with_eos, stop)[0]) == 4
    with pytest.raises(GenerationError, match="steps_per_call=0 must be at least 1"):
        Generator(model, max_len=32, steps_per_call=0)


def test_a_generator_takes_a_prepared_serving_model():
    """A serving model passed in is the one generate runs (no second copy of the weights), with the tokens of
    one the generator makes; one prepared from another config is refused."""
    model = init_model(tiny_model("mla", n_layer=1, vocab_size=128, output_init="normal"), seed=0)
    serving = ServingModel(model, prefill_chunk=4, min_bucket=16)
    generator = Generator(model, max_len=32, serving=serving)
    assert generator.serving is serving
    sampling = Sampling(max_new_tokens=6, eos_id=None)
    made = Generator(model, max_len=32, prefill_chunk=4, min_bucket=16)
    assert generator.generate(PROMPTS, sampling) == made.generate(PROMPTS, sampling)
    other = init_model(tiny_model("mla", n_layer=2, vocab_size=128), seed=0)
    with pytest.raises(ValueError, match="same model config"):
        Generator(other, max_len=32, serving=serving)


def test_a_generator_that_keeps_no_model_frees_its_float32_weights_and_generates_the_same_tokens():
    """keep_model=False (the generate CLI): the serving copy is made at once and the model's float32 block
    weights are freed with the model; generate gives the tokens of a generator that keeps it, and the
    stacked-cache path refuses with the fix."""
    cfg = tiny_model("mlra4", n_layer=1, vocab_size=128, output_init="normal", compute_dtype="bfloat16")
    sampling = Sampling(max_new_tokens=6, eos_id=None)
    expected = Generator(init_model(cfg, seed=0), max_len=32, prefill_chunk=4, min_bucket=16).generate(
        PROMPTS, sampling
    )
    model = init_model(cfg, seed=0)
    generator = Generator(model, max_len=32, prefill_chunk=4, min_bucket=16, keep_model=False)
    block_weight = weakref.ref(model.blocks.mlp.down_proj[...])
    assert block_weight().dtype == jnp.float32
    del model
    gc.collect()
    assert block_weight() is None
    assert generator.generate(PROMPTS, sampling) == expected
    with pytest.raises(GenerationError, match="keep_model=True for the stacked-cache prefill"):
        generator.prefill(PROMPTS)


def test_capacity_buckets():
    assert [capacity_bucket(n, 4096, 256) for n in (1, 256, 257, 385, 600, 3000, 5000)] == [
        256,
        256,
        384,
        512,
        768,
        3072,
        4096,
    ]
    assert [capacity_bucket(n, 100, 16) for n in (17, 25, 90, 100)] == [
        24,
        32,
        96,
        104,
    ]  # capped: the limit rounded to 8


def top_level_ops(hlo: str):
    """(op, dtype, dims) of the instructions outside fusion bodies."""
    computation = ""
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            continue
        if "fused" in computation or "fusion" in computation:
            continue
        match = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} ([\w\-]+)\(", line)
        if match:
            yield match.group(3), match.group(1), tuple(int(d) for d in match.group(2).split(",") if d)


def test_decode_step_updates_the_cache_in_place_and_reads_weights_in_the_compute_dtype():
    """The stacked path re-emits the whole stacked cache every step (the scan's output); the serving step
    aliases every cache buffer to its output and writes no array the size of a layer's cache except by the
    in-place dynamic-update-slice. Numbers of this CPU compile are in the README."""
    cfg = tiny_model("mlra4", n_layer=3, vocab_size=128, compute_dtype="bfloat16")
    model = init_model(cfg, seed=0)
    generator = Generator(model, max_len=1000)
    serving = generator.serving
    batch, slots = 2, 1000
    caches = init_layer_caches(cfg, batch, slots)
    compiled = (
        serving.compiled(True, (batch, 1)).lower(serving.weights, jnp.zeros((batch, 1), jnp.int32), caches).compile()
    )
    cache_bytes = sum(a.nbytes for layer in caches.layers for a in layer.values())
    assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes  # (and starts, index)
    layer_shapes = {a.shape for a in caches.layers[0].values()}
    writes = [
        (op, dims)
        for op, _, dims in top_level_ops(compiled.as_text())
        if dims in layer_shapes and op not in ("parameter", "get-tuple-element", "tuple", "bitcast")
    ]
    assert writes and all(op == "fusion" for op, _ in writes)  # the dynamic-update-slice fusions, one per buffer
    assert "dynamic-update-slice" in compiled.as_text()
    stacked_state = init_cache(cfg, batch, slots)
    graphdef = generator.graphdef
    stacked_step = jax.jit(lambda p, t, s: nnx.merge(graphdef, p).forward_cached(t, s), donate_argnums=(2,))
    stacked_hlo = (
        stacked_step.lower(generator.params, jnp.zeros((batch, 1), jnp.int32), stacked_state).compile().as_text()
    )
    stacked_shapes = {a.shape for a in stacked_state.kv.values()}
    assert any(
        dims in stacked_shapes and op not in ("parameter", "get-tuple-element", "tuple", "bitcast")
        for op, _, dims in top_level_ops(stacked_hlo)
    )  # the whole stacked cache is written each step
    dtypes = {a.dtype for layer in serving.weights["layers"] for a in jax.tree.leaves(layer)}
    assert dtypes == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}  # matmul weights bf16, norm scales f32
    assert serving.weights["layers"][0]["attn"]["q_up"].dtype == jnp.bfloat16
    assert serving.weights["head"].dtype == jnp.bfloat16 and serving.weights["embed"]["embedding"].dtype == jnp.float32


def test_a_call_of_several_steps_keeps_the_cache_in_place():
    """ServingModel.sampled_steps runs its steps in one XLA loop over the caches: every cache buffer aliases its
    output and no array of a layer's cache shape is copied, in the loop or around it."""
    cfg = tiny_model("mlra4", n_layer=3, vocab_size=128, compute_dtype="bfloat16")
    serving = Generator(init_model(cfg, seed=0), max_len=1000).serving
    caches = init_layer_caches(cfg, 2, 1000)
    greedy = jax.jit(functools.partial(sample, temperature=0.0, top_k=0, top_p=1.0))
    call = serving.compiled(True, (2, 1), greedy, 4)
    compiled = call.lower(serving.weights, jnp.zeros((2,), jnp.int32), caches, jax.random.key(0)).compile()
    assert compiled.memory_analysis().alias_size_in_bytes >= sum(a.nbytes for x in caches.layers for a in x.values())
    shapes = {",".join(map(str, a.shape)) for layer in caches.layers for a in layer.values()}
    hlo = compiled.as_text()
    copies = [m.group(1) for m in re.finditer(r"= \w+\[([\d,]*)\]\S* copy(?:-start)?\(", hlo)]
    assert " while(" in hlo and not shapes & set(copies), copies


@pytest.mark.parametrize(
    "spec, x_shape, w_shape, axes",
    [
        ("btd,dq->btq", (1, 1, 8), (8, 6), (0, 0)),  # a projection at batch 1
        ("btnhk,nrhk->btnhr", (1, 1, 2, 3, 4), (2, 5, 3, 4), (0, 0)),  # absorbed W_UK: block and head axes batched
        ("bd,vd->bv", (1, 8), (11, 8), (0, 0)),  # the tied head
        ("bthd,bshd->bhts", (1, 1, 2, 4), (1, 5, 2, 4), (1, 2)),  # decode scores: the query's one position
        ("btd,dq->btq", (3, 1, 8), (8, 6), None),  # three rows: unchanged
    ],
)
def test_a_single_row_product_is_computed_on_two_rows_with_the_same_result(spec, x_shape, w_shape, axes):
    x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32)
    w = jax.random.normal(jax.random.key(1), w_shape, jnp.float32)
    seen = []

    def product(spec, x, w):
        seen.append(x.shape)
        return jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)

    out = two_rows(product, spec, x, w)
    assert single_row_axes(spec, x_shape) == axes
    expected_rows = x_shape if axes is None else x_shape[: axes[0]] + (2,) + x_shape[axes[0] + 1 :]
    assert seen == [expected_rows]
    np.testing.assert_allclose(out, product(spec, x, w), rtol=1e-6, atol=1e-6)


def test_one_row_on_gpus_runs_the_mlp_and_the_latent_products_on_row_copies_with_the_same_logits(monkeypatch):
    """A batch-1 decode step as GPUs run it (row_copies and two_rows; the backend patched to "gpu" on CPU): the
    MLP and the latent family's query and output products run on copies of the row, and the logits are those
    of the plain step."""
    model = init_model(tiny_model("mlra4", n_layer=1, vocab_size=128, output_init="normal"), seed=0)
    generator = Generator(model, max_len=32, prefill_chunk=4, min_bucket=16)
    logits, state = generator.prefill(PROMPTS[:1])
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    expected, _ = model.forward_cached(token, state)
    copied = []

    def counted(x):
        out = row_copies(x)
        copied.append(out.shape[0])
        return out

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(layers_module, "row_copies", counted)
    monkeypatch.setattr(latent_module, "row_copies", counted)
    got, _ = model.forward_cached(token, state)
    assert copied == [ROW_COPIES] * 3  # the attention's queries and W_UV, the MLP
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_padded_mlp_gives_the_same_output():
    mlp = MLP(tiny_model("mha", intermediate_size=200, output_init="normal"), rngs=nnx.Rngs(0))
    graphdef, weights = nnx.split(mlp)
    padded = padded_mlp(nnx.to_pure_dict(weights), multiple=128)
    assert padded["gate_proj"].shape == (128, 256) and padded["down_proj"].shape == (256, 128)
    x = jax.random.normal(jax.random.key(3), (2, 3, 128), jnp.float32)
    np.testing.assert_allclose(nnx.merge(graphdef, padded)(x), mlp(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_row_kernels_decode_the_same_tokens_as_the_stacked_cache(variant):
    """Batch-1 decode steps on the row kernels (Pallas interpret mode): the stacked path's greedy tokens, from
    weights stored out-major, which the prefill's XLA path reads too."""
    model = init_model(tiny_model(variant, n_layer=1, vocab_size=128, output_init="normal"), seed=0)
    serving = ServingModel(model, prefill_chunk=4, min_bucket=16, row_kernels="interpret")
    layer = serving.weights["layers"][0]
    d, f = model.config.n_embd, layer["mlp"]["down_proj"].shape[-1]
    assert serving.rows and layer["mlp"]["gate_up"].shape == (2, f, d) and layer["mlp"]["down_proj"].shape == (d, f)
    assert layer["attn"]["o_proj"].shape[0] == d
    if "x_proj" in layer["attn"]:
        assert layer["attn"]["x_proj"].shape[-1] == d and layer["attn"]["q_up"].shape[-1] == model.config.q_lora_rank
    generator = Generator(model, max_len=32, serving=serving)
    prompt = PROMPTS[1][:5]
    assert generator.generate([prompt], Sampling(max_new_tokens=6, eos_id=None)) == stacked_greedy(
        generator, [prompt], 6
    )
    assert ("step", 1, 16) in serving.traces


@pytest.mark.parametrize("variant", ["mlra4", "gqa"])
def test_row_kernels_serve_gated_models_and_larger_batches_read_their_layout(variant):
    """A gated model's batch-1 steps (the gate in XLA, between the row kernels), and a batch of three on XLA
    over the out-major weights, decode the stacked path's tokens."""
    model = init_model(tiny_model(variant, n_layer=1, vocab_size=128, output_init="normal", gated=True), seed=0)
    generator = Generator(
        model, max_len=32, serving=ServingModel(model, prefill_chunk=4, min_bucket=16, row_kernels="interpret")
    )
    for prompts in (PROMPTS[:1], PROMPTS):
        assert generator.generate(prompts, Sampling(max_new_tokens=4, eos_id=None)) == stacked_greedy(
            generator, prompts, 4
        )


def test_row_kernels_serve_a_one_device_mesh_and_refuse_a_larger_one():
    """A mesh of one device (as benchmarks deploy a model on one GPU) splits nothing: its batch-1 steps run on the row
    kernels and decode the stacked path's tokens; a mesh of two devices is refused by name."""
    from mlra_jax.config import MeshConfig
    from mlra_jax.sharding import make_mesh

    model = init_model(tiny_model("mlra4", n_layer=1, vocab_size=128, output_init="normal"), seed=0)
    one = make_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1])
    serving = ServingModel(model, mesh=one, prefill_chunk=4, min_bucket=16, row_kernels="interpret")
    assert serving.rows
    generator = Generator(model, max_len=32, mesh=one, serving=serving)
    prompt = PROMPTS[2]
    assert generator.generate([prompt], Sampling(max_new_tokens=4, eos_id=None)) == stacked_greedy(
        Generator(model, max_len=32), [prompt], 4
    )
    two = make_mesh(MeshConfig(data=2, tensor=1), jax.devices()[:2])
    with pytest.raises(ValueError, match="a mesh of 2 splits the weights"):
        ServingModel(model, mesh=two, row_kernels="interpret")


def test_row_kernels_refuse_what_they_cannot_serve():
    model = init_model(tiny_model("mlra4", n_layer=1, vocab_size=128), seed=0)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="run on NVIDIA GPUs.*row_kernels='auto' or 'off'"):
            ServingModel(model, row_kernels="on")
        assert not ServingModel(model).rows  # auto: XLA here
    with pytest.raises(ValueError, match="row_kernels='fast': use one of auto, on, off, interpret"):
        ServingModel(model, row_kernels="fast")
    odd = init_model(tiny_model("mlra4", n_layer=1, vocab_size=128, kv_lora_rank=96), seed=0)  # rank 24 per block
    with pytest.raises(ValueError, match="power-of-two latent rank per block; got 24"):
        ServingModel(odd, row_kernels="interpret")


@on_gpu
@pytest.mark.parametrize("variant", ["mlra4", "mla", "gla2", "mlra2", "gqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_kernels_on_gpu_give_the_xla_steps_logits(variant, dtype):
    """Compiled on a GPU (Triton, and the Mosaic GPU attention kernel): the row path's logits are the XLA path's
    up to the summation order, step after step, both fed the XLA path's greedy tokens."""
    cfg = tiny_model(
        variant,
        n_layer=2,
        n_embd=256,
        n_head=4,
        vocab_size=512,
        output_init="normal",
        compute_dtype=dtype,
        **(
            {}
            if variant == "gqa"
            else dict(q_lora_rank=128, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64)
        ),
    )
    model = init_model(cfg, seed=0)
    servings = [ServingModel(model, min_bucket=64, row_kernels=mode) for mode in ("on", "off")]
    prompt = np.random.default_rng(0).integers(0, 512, (1, 40))
    sessions = [serving.prefill(prompt, np.zeros(1, np.int32), 16, 64) for serving in servings]
    token = jnp.argmax(sessions[0][0], axis=-1).astype(jnp.int32)[:, None]
    for _ in range(16):
        logits = [serving.step(token, session) for serving, (_, session) in zip(servings, sessions)]
        scale = float(jnp.abs(logits[1]).max())
        np.testing.assert_allclose(logits[0], logits[1], atol=(1e-5 if dtype == "float32" else 2e-2) * scale)
        token = jnp.argmax(logits[1], axis=-1).astype(jnp.int32)[:, None]
    assert servings[0].rows and not servings[1].rows
