"""Decode benchmarks.

    mlra bench decode attention --impls=xla --out=experiments/results/decode_attention.json
    mlra bench decode model --experiments=mlra4_2p9b,mla_2p9b --batch=1,64 --context=8192

`attention`: one decode step of attention on one device at the paper's per-device
settings (docs/conventions.md): MLRA-4 at TP=4 (64 heads over a 128-wide latent block plus
a 64-wide RoPE key), GLA-2 at TP=2 (32 heads, 256 + 64), MLA (64 heads, 512 + 64) and
GQA at TP=8 (8 query heads on one 128-wide KV head); batch 1 at 128K-2M tokens and
batch 128 at 1K-16K. It reports the median time per call, the ideal time (cache bytes
over 3.35 TB/s and over the device-to-device copy bandwidth measured in the same run)
and the achieved bandwidth, for each implementation in --impls. Times are device times
from the profiler's GPU trace: the span of 8 calls chained in one jitted function (each
output feeding the next call's query) over 8, median of --repeats, with each kernel's
share (common.device_time). A jitted fori_loop is not used: XLA's GPU while loop makes a
host round trip per iteration (about 25 us here). The wall time of single calls, which
adds the host's dispatch, is recorded too.

GQA (TP=4), `gqa4`, is the per-device shape of DeepSeek-V3's GQA layer at TP=4 (32 query heads on 4 KV heads of
128): impl `xla_as_stored` is the model's XLA path there (attention.gqa.attend_as_stored: the (query, head) rows
against the cache's (slot, KV head) rows as stored, masked to GQA's pairs), `gqa_kernel` our Pallas Triton decode
kernel as the model runs it (attention.gqa_kernel: the ranges from the mask, then the kernel), optionally with its
tiling as `gqa_kernel:BLOCK_S:WARPS:STAGES:SPLITS` (SPLITS 0: chosen for the GPU); `pallas` is JAX's kernel. --batch
sets the batch of the --batch128_contexts settings:

    mlra bench decode attention --variants=gqa4 --impls=xla_as_stored,xla,gqa_kernel --batch=64 \
        --batch1_contexts= --batch128_contexts=1024,8192,16384 --out=decode_attention_gqa_kernel.json

`model`: whole-model decode steps on the serving path (decode.serving: bf16 weights split
per layer, per-layer caches updated in place) for experiments, attention implementations,
batch sizes and contexts: time per step (on GPUs the profiler's span, with the top kernels),
tokens/s, and the bandwidth floor, the bytes a step must read (weights + `context` cached
tokens per sequence and layer) over the device-to-device copy bandwidth of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mlra_jax.benchmarks import roofline
from mlra_jax.benchmarks.common import (
    benchmark_params,
    device_time,
    earlier_results,
    environment,
    median_time,
    profiled_time,
    save,
)
from mlra_jax.decode.generator import STEPS_PER_CALL, Generator, Sampling

H100_BANDWIDTH = 3.35e12  # bytes/s, the paper's ideal-time reference
BATCH1_CONTEXTS = (131072, 262144, 524288, 1048576, 2097152)
BATCH128_CONTEXTS = (1024, 2048, 4096, 8192, 16384)
PAGE = 64  # slots per page of the paged-cache measurement (impl pallas_paged)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    heads: int  # query heads on the device
    latent: int  # latent width (0 for GQA)
    rope: int  # RoPE key width (0 for GQA)
    kv_heads: int = 0  # GQA only
    head_dim: int = 0  # GQA only

    def cache_bytes(self, batch: int, context: int) -> int:
        per_token = self.latent + self.rope if self.latent else 2 * self.kv_heads * self.head_dim
        return batch * context * per_token * 2  # bf16

    def flops(self, batch: int, context: int) -> int:
        """The attention's FLOPs: each query head's scores over its key width and its sum over its value width."""
        key, value = (self.latent + self.rope, self.latent) if self.latent else (self.head_dim, self.head_dim)
        return batch * context * self.heads * 2 * (key + value)


CASES = {
    "mlra4": AttentionCase("MLRA-4 (TP=4)", heads=64, latent=128, rope=64),
    "gla2": AttentionCase("GLA-2 (TP=2)", heads=32, latent=256, rope=64),
    "mla": AttentionCase("MLA", heads=64, latent=512, rope=64),
    "gqa": AttentionCase("GQA (TP=8)", heads=8, latent=0, rope=0, kv_heads=1, head_dim=128),
    "gqa4": AttentionCase("GQA (TP=4)", heads=32, latent=0, rope=0, kv_heads=4, head_dim=128),
}
GQA_IMPLS = ("xla_as_stored", "gqa_kernel")  # GQA only: the model's TP path on XLA, and our kernel


def gqa_kernel_tiling(impl: str):
    """The tiling of impl `gqa_kernel[:BLOCK_S:WARPS:STAGES:SPLITS]` (the kernel's default without fields)."""
    from mlra_jax.pallas_kernels.gqa_decode_gpu import DEFAULT_TILING, Tiling

    fields = impl.split(":")[1:]
    if not fields:
        return DEFAULT_TILING
    if len(fields) != 4:
        raise ValueError(f"{impl!r}: write gqa_kernel:BLOCK_S:WARPS:STAGES:SPLITS")
    block_s, warps, stages, splits = map(int, fields)
    return Tiling(block_s=block_s, num_warps=warps, num_stages=stages, splits=splits)


def _length_mask(lengths: jax.Array, context: int) -> jax.Array:
    return jnp.arange(context)[None, None, :] < lengths[:, None, None]


def attention_fn(case: AttentionCase, impl: str, batch: int, context: int) -> tuple[Callable, tuple]:
    """A jitted decode-attention call and its random inputs (bf16, a full cache of `context` tokens).
    The output has the shape of the second argument (the latent query) or of the first (GQA's query), so
    `feed_argument` can chain calls."""
    from mlra_jax.attention.core import attention, latent_attention

    keys = jax.random.split(jax.random.key(1), 4)
    lengths = jnp.full((batch,), context, jnp.int32)
    if case.latent:
        q_rope = jax.random.normal(keys[0], (batch, 1, 1, case.heads, case.rope), jnp.bfloat16)
        q_latent = jax.random.normal(keys[1], (batch, 1, 1, case.heads, case.latent), jnp.bfloat16)
        k_rope = jax.random.normal(keys[2], (batch, context, case.rope), jnp.bfloat16)
        latent = jax.random.normal(keys[3], (batch, context, 1, case.latent), jnp.bfloat16)
        scale = (case.latent + case.rope) ** -0.5

        if impl == "pallas_paged":
            return _paged_latent_fn(q_rope, q_latent, k_rope, latent, lengths, scale)

        def run(q_rope, q_latent, k_rope, latent, lengths):
            return latent_attention(
                q_rope, q_latent, k_rope, latent, scale=scale, mask=_length_mask(lengths, context), impl=impl
            )

        return jax.jit(run), (q_rope, q_latent, k_rope, latent, lengths)
    q = jax.random.normal(keys[0], (batch, 1, case.heads, case.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, context, case.kv_heads, case.head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, context, case.kv_heads, case.head_dim), jnp.bfloat16)
    scale = case.head_dim**-0.5
    if impl.split(":")[0] in GQA_IMPLS:
        return _gqa_fn(q, k, v, lengths, impl, scale)
    if impl == "pallas":  # JAX's split-K GQA decode kernel (pallas/ops/gpu/decode_attention.py)
        from jax.experimental.pallas.ops.gpu.decode_attention import gqa

        from mlra_jax.pallas_kernels.latent_decode_common import choose_splits

        splits = 1 << (choose_splits(batch * case.kv_heads, context, 128, 132).bit_length() - 1)  # must divide

        def split_k(q, k, v, lengths):
            out = gqa(q[:, 0], k, v, kv_seq_len=lengths, sm_scale=scale, k_splits=splits, block_h=16, block_k=128)
            return out[:, None].astype(q.dtype)  # the kernel returns float32

        return jax.jit(split_k), (q, k, v, lengths)
    if impl == "cudnn":
        return jax.jit(
            lambda q, k, v, lengths: jax.nn.dot_product_attention(
                q, k, v, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn"
            )
        ), (q, k, v, lengths)

    def run(q, k, v, lengths):
        return attention(q, k, v, scale=scale, impl="xla", mask=_length_mask(lengths, context))

    return jax.jit(run), (q, k, v, lengths)


def _gqa_fn(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, impl: str, scale: float):
    """GQA's decode attention on one device as the model runs it under TP, each device over the KV heads it stores:
    on XLA (impl xla_as_stored) or on our kernel (gqa_kernel[:tiling])."""
    from mlra_jax.attention import gqa_kernel
    from mlra_jax.attention.gqa import attend_as_stored
    from mlra_jax.tensor_parallel import UnitPlan

    context, kv, heads = k.shape[1], k.shape[2], q.shape[2]
    if impl == "xla_as_stored":
        paired = (jnp.arange(heads) // (heads // kv))[:, None] == jnp.arange(kv)[None, :]

        def as_stored(q, k, v, lengths):
            return attend_as_stored(q, k, v, _length_mask(lengths, context), paired, scale)

        return jax.jit(as_stored), (q, k, v, lengths)
    tiling = gqa_kernel_tiling(impl)

    def on_kernel(q, k, v, lengths):
        mask = _length_mask(lengths, context)
        return gqa_kernel.gqa_decode_attention(q, k, v, mask, UnitPlan(kv, 1, heads), scale, tiling=tiling)

    return jax.jit(on_kernel), (q, k, v, lengths)


def _paged_latent_fn(
    q_rope: jax.Array, q_latent: jax.Array, k_rope: jax.Array, latent: jax.Array, lengths: jax.Array, scale: float
) -> tuple[Callable, tuple]:
    """The latent kernel over a paged cache of the same size: the cache's bytes as a pool of PAGE-slot pages,
    and a page table that hands each sequence pages from all over the pool in random order (as a serving
    engine's allocator leaves them; the values read differ from the contiguous run's, the bytes do not).
    The ranges come from the mask as in the model's path."""
    from mlra_jax.attention.latent_kernels import kernel_for_backend, ranges_from_mask

    batch, context = k_rope.shape[:2]
    pages = batch * context // PAGE
    table = jax.random.permutation(jax.random.key(2), pages).astype(jnp.int32).reshape(batch, context // PAGE)
    pool_k, pool_latent = k_rope.reshape(pages, PAGE, -1), latent.reshape(pages, PAGE, *latent.shape[2:])
    kernel = kernel_for_backend()

    def run(q_rope, q_latent, pool_k, pool_latent, table, lengths):
        starts, ends = ranges_from_mask(_length_mask(lengths, context))
        out = kernel(q_rope[:, 0], q_latent[:, 0], pool_k, pool_latent, starts, ends, scale=scale, page_table=table)
        return out[:, None]

    return jax.jit(run), (q_rope, q_latent, pool_k, pool_latent, table, lengths)


def feed_argument(case: AttentionCase) -> int:
    """The argument of attention_fn's call that its output can replace when calls are chained."""
    return 1 if case.latent else 0


def bench_attention(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every (variant, setting, impl); the JSON is rewritten after each result, so a run cut short keeps what
    it measured. With --merge, results of an earlier run in --out that this run does not measure are kept
    (each result names the copy bandwidth of its own run)."""
    ceilings = roofline.measured_ceilings(args.copy_gb)
    bandwidth = ceilings["copy_bandwidth_bytes_per_s"]
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s", flush=True)
    settings = [(1, c) for c in args.batch1_contexts] + [(args.batch, c) for c in args.batch128_contexts]
    kept, runs = _earlier_results(args, settings)
    extra = {
        "copy_bandwidth_bytes_per_s": bandwidth,
        "ceilings": ceilings,
        "runs": [*runs, {**environment(), "copy_bandwidth_bytes_per_s": bandwidth}],
    }
    results = kept
    for variant in args.variants.split(","):
        case = CASES[variant]
        for batch, context in settings:
            for impl in args.impls.split(","):
                if case.latent and (impl == "cudnn" or impl.split(":")[0] in GQA_IMPLS):
                    continue  # cuDNN has no latent decode (MQA over a latent plus a RoPE key), nor the GQA impls
                if not case.latent and impl == "pallas_paged":
                    continue  # GQA has no paged kernel
                try:
                    fn, inputs = attention_fn(case, impl, batch, context)
                    wall = median_time(lambda: fn(*inputs), repeats=args.repeats)
                    timing = device_time(fn, inputs, repeats=args.repeats, feed=feed_argument(case))
                    seconds = timing["time_s"]
                except Exception as err:  # noqa: BLE001 - record it and go on with the other settings
                    message = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                    results.append(
                        {"variant": variant, "impl": impl, "batch": batch, "context": context, "error": message}
                    )
                    save(args.out, "decode_attention", results, **extra)
                    print(f"{case.name:14} {impl:12} B={batch:<4} ctx={context:<8} failed: {message}", flush=True)
                    continue
                moved = case.cache_bytes(batch, context)
                result = {
                    "variant": variant,
                    "case": case.name,
                    "impl": impl,
                    "batch": batch,
                    "context": context,
                    "time_s": seconds,
                    "timing": timing["method"],
                    "kernels_s": timing.get("kernels_s", {}),
                    "wall_time_per_call_s": wall,
                    "bytes": moved,
                    "achieved_gb_s": moved / seconds / 1e9,
                    "ideal_time_s_3p35": moved / H100_BANDWIDTH,
                    "ideal_time_s_measured": moved / bandwidth,
                    "fraction_of_measured_bandwidth": moved / bandwidth / seconds,
                    **roofline.floor(0, moved, case.flops(batch, context), ceilings, seconds),
                }
                if "kernels_s" in timing:
                    result["kernel_sum_s"] = roofline.kernel_sum(timing["kernels_s"])
                results.append(result)
                save(args.out, "decode_attention", results, **extra)
                print(
                    f"{case.name:14} {impl:12} B={batch:<4} ctx={context:<8} {seconds * 1e6:10.1f} us "
                    f"(wall {wall * 1e6:7.1f})  "
                    f"{result['achieved_gb_s']:8.0f} GB/s  {result['fraction_of_measured_bandwidth']:6.1%} of copy",
                    flush=True,
                )
    return results, extra


def _earlier_results(args: argparse.Namespace, settings: list[tuple[int, int]]) -> tuple[list[dict], list[dict]]:
    """With --merge: the results in --out that this run will not measure again, and the runs they came from."""
    if not args.merge:
        return [], []
    planned = {(v, i, b, c) for v in args.variants.split(",") for i in args.impls.split(",") for b, c in settings}
    kept, runs, record = earlier_results(
        args.out,
        lambda r: (r["variant"], r["impl"], r["batch"], r["context"]) in planned,
        ("device", "command", "date", "jax_version", "copy_bandwidth_bytes_per_s"),
    )
    for result in kept:
        result.setdefault("copy_bandwidth_bytes_per_s", record.get("copy_bandwidth_bytes_per_s"))
    return kept, runs


def serving_floor_bytes(serving, batch: int, context: int) -> dict[str, int]:
    """Bytes one decode step must read at least: every weight a step reads (the layers, the final norm and the
    tied head, as stored for serving; the embedding table only for the batch's rows) and `context` cached
    tokens per sequence and layer."""
    weights = serving.weights
    read = [weights["layers"], weights["final_norm"], weights["head"]]
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(read))
    weight_bytes += batch * weights["embed"]["embedding"].shape[1] * weights["embed"]["embedding"].dtype.itemsize
    from mlra_jax.cache_accounting import cache_layout

    per_token = sum(c.elements for c in cache_layout(serving.cfg)) * jnp.dtype(serving.cfg.dtype).itemsize
    return {"weight_bytes": int(weight_bytes), "cache_bytes": int(batch * context * per_token * serving.cfg.n_layer)}


def serving_flops(serving, batch: int, context: int) -> float:
    """FLOPs of one decode step on one device: two per weight element that multiplies (the layers' and the tied
    head's) and row, and the attention over `context` cached tokens per sequence and layer."""
    matrices = roofline.matrix_elements({"layers": serving.weights["layers"], "head": serving.weights["head"]})
    attention = serving.cfg.n_layer * batch * context * roofline.attention_flops_per_token(serving.cfg, 1)
    return 2 * matrices * batch + attention


def bench_model(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Whole-model decode steps on the serving path (decode.serving: bf16 weights split per layer, per-layer caches
    donated and updated in place, a capacity bucket of exactly `context` slots), against the bandwidth floor: the
    bytes a step must read (serving_floor_bytes) over the device-to-device copy bandwidth of the same run."""
    from flax import nnx

    from mlra_jax.decode.serving import ServingModel
    from mlra_jax.experiments import get_experiment
    from mlra_jax.kv_cache import init_layer_caches
    from mlra_jax.model import abstract_model

    ceilings = roofline.measured_ceilings(args.copy_gb)
    bandwidth = ceilings["copy_bandwidth_bytes_per_s"]
    print(
        f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s, bf16 matmul {ceilings['bf16_flops_per_s'] / 1e12:.0f} "
        "TFLOP/s",
        flush=True,
    )
    extra = {"copy_bandwidth_bytes_per_s": bandwidth, "ceilings": ceilings}
    results = []
    for name in args.experiments.split(","):
        base = dataclasses.replace(
            get_experiment(name).model,
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            max_seq_len=max(map(int, args.context.split(","))),
        )
        params = benchmark_params(base)
        for impl in args.impls.split(","):
            cfg = dataclasses.replace(base, attention_impl=impl)
            model = nnx.merge(nnx.split(abstract_model(cfg))[0], params)
            serving = ServingModel(model)
            for batch in map(int, args.batch.split(",")):
                for context in map(int, args.context.split(",")):
                    result = {
                        "experiment": name,
                        "variant": cfg.variant,
                        "impl": impl,
                        "batch": batch,
                        "context": context,
                    }
                    try:
                        result.update(_time_serving_step(serving, batch, context, args, init_layer_caches))
                    except Exception as err:  # noqa: BLE001 - record it and go on with the other settings
                        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                        print(f"{name:14} {impl:6} B={batch:<4} ctx={context:<7} failed: {result['error']}", flush=True)
                        results.append(result)
                        save(args.out, "decode_model", results, **extra)
                        continue
                    floor = serving_floor_bytes(serving, batch, context)
                    seconds = result["step_time_s"]
                    result.update(
                        roofline.floor(
                            floor["weight_bytes"],
                            floor["cache_bytes"],
                            serving_flops(serving, batch, context),
                            ceilings,
                            seconds,
                        )
                    )
                    floor_s = result["floor_time_s"]
                    result.update(tokens_per_s=batch / seconds, floor_tokens_per_s=batch / floor_s)
                    if args.generate_tokens:
                        result.update(_time_generate(model, serving, batch, context, args.generate_tokens))
                        result["generate_over_floor"] = result["generate_s_per_token"] / floor_s
                    results.append(result)
                    save(args.out, "decode_model", results, **extra)
                    generated = (
                        f"; generate {result['generate_s_per_token'] * 1e3:.3f} ms/token"
                        if args.generate_tokens
                        else ""
                    )
                    print(
                        f"{name:14} {impl:6} B={batch:<4} ctx={context:<7} {seconds * 1e3:8.3f} ms/step "
                        f"{batch / seconds:10.0f} tokens/s   floor {floor_s * 1e3:7.3f} ms "
                        f"({floor['weight_bytes'] / 1e9:.2f} GB weights + {floor['cache_bytes'] / 1e9:.2f} GB cache)"
                        f"  {seconds / floor_s:5.2f}x floor{generated}",
                        flush=True,
                    )
            del serving
    return results, extra


def _time_generate(model, serving, batch: int, context: int, new_tokens: int) -> dict:
    """Wall time per new token of Generator.generate (greedy, every row running to new_tokens) from random
    prompts that end the decoding at `context` tokens, over the last of three calls: the tokens of a decode call
    reach the host together, so the time from the first token of its second decode call to the first of its last,
    over the tokens between them."""
    generator = Generator(model, max_len=context, serving=serving)
    steps = generator.steps_per_call
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, context - new_tokens)).tolist()
    stamps: list[float] = []

    def stamp(row: int, tokens: list[int]) -> bool:
        if row == 0:
            stamps.append(time.perf_counter())
        return False

    for _ in range(3):
        stamps.clear()
        generator.generate(prompts, Sampling(max_new_tokens=new_tokens, eos_id=None), stop=stamp)
    firsts = stamps[1::steps]  # the first token of each decode call (token 0 comes from the prefill)
    return {
        "generate_tokens": new_tokens,
        "generate_s_per_token": (firsts[-1] - firsts[1]) / (steps * (len(firsts) - 2)),
        "generate_timing": f"Generator.generate, wall time per new token over whole calls of {steps} decode steps",
    }


def _time_serving_step(serving, batch: int, context: int, args: argparse.Namespace, init_layer_caches) -> dict:
    """Time per step of the serving decode step on random caches of `context` slots holding about `context`
    tokens (it starts at context - 64 and advances one slot per call)."""
    calls = 2 * (args.repeats + 2) + 2  # median_time and profiled_time, with their warm-ups
    if context < calls + 8:
        raise ValueError(f"context {context} is too short for {calls} timed steps")
    caches = init_layer_caches(serving.cfg, batch, context)
    key = jax.random.key(2)
    layers = tuple(
        {n: jax.random.normal(jax.random.fold_in(key, i), a.shape, a.dtype) for n, a in layer.items()}
        for i, layer in enumerate(caches.layers)
    )
    holder = {"caches": dataclasses.replace(caches, layers=layers, index=jnp.int32(context - calls - 1))}
    del caches, layers
    tokens = jnp.zeros((batch, 1), jnp.int32)

    step = serving.compiled(True, tokens.shape)

    def run():
        logits, holder["caches"] = step(serving.weights, tokens, holder["caches"])
        return logits

    wall = median_time(run, repeats=args.repeats)
    timing = {"step_time_s": wall, "timing": "wall time per step (median)"}
    if jax.default_backend() == "gpu":
        profiled = profiled_time(run, repeats=args.repeats)
        top = sorted(profiled["kernels_s"].items(), key=lambda kv: -kv[1])[:12]
        kernels = roofline.kernel_sum(profiled["kernels_s"])
        timing = {
            "step_time_s": profiled["time_s"],
            "timing": "profiler span per step (median)",
            "wall_time_per_step_s": wall,
            "kernel_sum_s": kernels,
            "span_over_kernels": profiled["time_s"] / kernels,
            "kernels_s": dict(top),
        }
        if args.timeline:
            timing["step_timeline"] = profiled["timeline"]
    return timing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    attention = sub.add_parser("attention", help="per-device decode attention at the paper's settings")
    attention.add_argument("--variants", default="mlra4,mla,gla2,gqa")
    attention.add_argument(
        "--impls",
        default="xla",
        help="comma-separated: xla, pallas, pallas_paged (the latent kernel over a paged cache), cudnn; GQA also "
        "xla_as_stored and gqa_kernel[:BLOCK_S:WARPS:STAGES:SPLITS]",
    )
    attention.add_argument(
        "--batch1_contexts", type=lambda s: [int(x) for x in s.split(",") if x], default=list(BATCH1_CONTEXTS)
    )
    attention.add_argument(
        "--batch128_contexts", type=lambda s: [int(x) for x in s.split(",") if x], default=list(BATCH128_CONTEXTS)
    )
    attention.add_argument("--batch", type=int, default=128, help="the batch of the --batch128_contexts settings")
    attention.add_argument("--repeats", type=int, default=20)
    attention.add_argument("--copy_gb", type=float, default=4.0, help="size of the bandwidth-reference copy")
    attention.add_argument("--out", type=Path, default=Path("experiments/results/decode_attention.json"))
    attention.add_argument(
        "--merge",
        action="store_true",
        help="keep the results already in --out for the settings this run does not measure",
    )
    model = sub.add_parser("model", help="whole-model decode steps on the serving path, against the bandwidth floor")
    model.add_argument("--experiments", default="mlra4_2p9b,mla_2p9b")
    model.add_argument("--batch", default="1,64")
    model.add_argument("--context", default="8192")
    model.add_argument(
        "--impls", default="xla,pallas", help="comma-separated attention_impl values (xla, pallas, auto)"
    )
    model.add_argument("--repeats", type=int, default=20)
    model.add_argument("--copy_gb", type=float, default=4.0, help="size of the bandwidth-reference copy")
    model.add_argument(
        "--timeline",
        action="store_true",
        help="also save each setting's step as its ordered kernels (name, start and duration in us; "
        "GPUs): the profile that says where a step's time goes",
    )
    model.add_argument(
        "--generate_tokens",
        type=int,
        default=0,
        help="also time Generator.generate per new token, decoding this many tokens up to the context",
    )
    model.add_argument("--out", type=Path, default=Path("experiments/results/decode_model.json"))
    args = parser.parse_args(argv)
    if args.mode == "model" and args.generate_tokens:
        shortest = min(int(c) for c in args.context.split(","))
        fewest = 2 * STEPS_PER_CALL + 2  # the prefill's token, a first decode call, two calls timed
        if not fewest <= args.generate_tokens < shortest:
            parser.error(
                f"--generate_tokens={args.generate_tokens}: use at least {fewest} (whole decode calls of "
                f"{STEPS_PER_CALL} steps are timed, the first left out) and fewer than the shortest --context "
                f"({shortest})"
            )
    results, extra = bench_attention(args) if args.mode == "attention" else bench_model(args)
    record = save(args.out, f"decode_{args.mode}", results, **extra)
    print(f"saved {args.out} ({record['device']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
