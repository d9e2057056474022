"""Decoding throughput on several devices (the paper's Sec. 5 study), of the attention layer and of whole models.

    mlra bench decode_throughput --devices=4 --out=experiments/results/decode_throughput_4gpu.json

For each variant it deploys over a DP x TP mesh of --devices devices as the paper does on 8 GPUs
(experiments/benchmarks.py: GQA TP=8, MLA DP=8, GLA-2 TP=2, MLRA-4 TP=4, DP taking the other devices;
on fewer devices the TP degree is capped at the device count), fills the caches to each context
length, and times one decode step for the whole batch (tokens/s = batch / step time):

* scope `attention`: one layer of DeepSeek-V3's attention shape (THROUGHPUT_MODELS), as the paper
  measures: pre-attention projections, cache write and attention (absorbed for the latent family), with the
  weights held as the serving layer holds them (decode.layouts.tensor_parallel_weights); with --steps_per_call=K
  also calls of K of its steps in one program (`call_step_s`): a single step of one layer is short enough
  (0.1-0.3 ms) that its dispatch bounds it;
* scope `model`: the 2.9B model ({variant}_2p9b) on the serving path (decode.serving: bf16 weights
  split per layer, per-layer caches updated in place), embedding to logits; with --steps_per_call=K
  (default: generate's, 8) also calls of K greedy steps that sample, as `generate` runs them, dispatched back to
  back (`call_step_s` per step, `call_over_floor`). Single steps dispatched back to back make XLA record the
  step's CUDA graphs again every step; a call's steps record them once.

--attention_impl auto (default) takes the Pallas kernels for the latent family's decode where they run
(Hopper GPUs, TPUs) and GQA's decode kernel on NVIDIA GPUs (attention.gqa_kernel), XLA elsewhere. On GPUs
the step time is the profiler's span on device 0 (the wall time, the sum of all kernels and the top kernels are
recorded too); elsewhere the median wall time.

Every row gives its roofline on one device (benchmarks.roofline): the weight and cache bytes the device must read,
the FLOPs it must do, the floor at the copy bandwidth and bf16 matrix rate measured in the same process, the step
as a multiple of the floor, and the compiled step's collectives (count by kind and bytes). Each (scope, variant)
runs in a process of its own (--isolate, the default), so that a failure (out of memory) loses only its own rows;
`mlra bench throughput_figure RECORD` draws the study's figure with the floors.

--processes=N runs the measurement in N processes of one device each (jax.distributed on this host, as a serving
deployment of one process per GPU runs), so that no process launches the kernels of more than one device; process
0 profiles its device and writes --out. The processes' steps start apart, so there the profiled span of a step
holds the others' lag inside its collectives: compare `pipelined_step_s` (steps dispatched back to back).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax import peer_exchange, tensor_parallel
from mlra_jax.attention import attention_class
from mlra_jax.benchmarks import roofline
from mlra_jax.benchmarks.common import (
    compiled_memory,
    earlier_results,
    environment,
    filled_like,
    filled_params,
    median_time,
    profiled_time,
    refilled,
    save,
)
from mlra_jax.config import MeshConfig, ModelConfig
from mlra_jax.decode import layouts, region_block, serving, serving_block
from mlra_jax.decode.generator import STEPS_PER_CALL as STEPS_PER_GENERATE_CALL
from mlra_jax.decode.generator import sample
from mlra_jax.decode.serving import ServingModel, serving_compiler_options
from mlra_jax.experiments.benchmarks import PAPER_BATCH, THROUGHPUT_CONTEXTS, THROUGHPUT_MODELS, deployment
from mlra_jax.kv_cache import init_cache, init_layer_caches, slot_mask
from mlra_jax.params import logical_axes
from mlra_jax.sharding import batch_sharding, make_mesh, tree_shardings

SCOPES = ("attention", "model")


def whole_model(variant: str) -> ModelConfig:
    """The model of scope `model`: the paper's 2.9B run of the variant."""
    from mlra_jax.experiments import get_experiment

    return get_experiment(f"{variant}_2p9b").model


def with_impl(cfg: ModelConfig, impl: str) -> ModelConfig:
    """The latent family and GQA (attention.gqa_kernel) decode with `impl`; the others keep XLA (no decode kernel
    of ours covers them)."""
    kernel = cfg.spec.latent_layout or cfg.spec.attention.startswith("gqa.")
    return dataclasses.replace(cfg, attention_impl=impl if kernel else "xla")


def pipelined_time(run: Callable[[], Any], steps: int) -> float:
    """Wall seconds per step of `steps` calls of run() dispatched back to back, blocking only on the last (as a
    server decodes: the host enqueues a step while the device runs the one before)."""
    jax.block_until_ready(run())
    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = run()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


ROW_KERNELS = "auto"  # --row_kernels: ServingModel's row_kernels (batch-1 steps on one device)
KEEP_TIMELINE = False  # --timeline: each GPU row keeps the kernels of its median step (and call) on device 0


def time_step(run: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Seconds per call of run(): the profiler's span on GPUs (with the wall time of single steps and of steps
    dispatched back to back, the sum of all kernels and the top kernels, and with KEEP_TIMELINE the median
    step's kernels: name, start and duration in us), else the median wall time."""
    wall = median_time(run, repeats=repeats)
    pipelined = pipelined_time(run, repeats)
    if jax.default_backend() != "gpu":
        return {"step_time_s": wall, "timing": "wall time per step (median)", "pipelined_step_s": pipelined}
    profiled = profiled_time(run, repeats=repeats)
    top = dict(sorted(profiled["kernels_s"].items(), key=lambda kv: -kv[1])[:10])
    kernels = roofline.kernel_sum(profiled["kernels_s"])
    return {
        "step_time_s": profiled["time_s"],
        "timing": "profiler span per step on device 0 (median)",
        "wall_time_per_step_s": wall,
        "pipelined_step_s": pipelined,
        "kernel_sum_s": kernels,
        "span_over_kernels": profiled["time_s"] / kernels,
        "kernels_s": top,
        **({"timeline": profiled["timeline"]} if KEEP_TIMELINE else {}),
    }


def measure_attention(
    variant: str,
    contexts: list[int],
    repeats: int,
    impl: str,
    devices: list[jax.Device],
    batch: int,
    results: list[dict],
    ceilings: dict[str, float],
) -> None:
    """One decode step of one attention layer (DeepSeek-V3's shape) per context, appended to results."""
    cfg = with_impl(THROUGHPUT_MODELS[variant], impl)
    tp, dp, _ = deployment(variant, len(devices))
    mesh = make_mesh(MeshConfig(data=dp, tensor=tp), devices)
    attn = nnx.eval_shape(lambda: attention_class(variant)(cfg, rngs=nnx.Rngs(params=0)))
    graphdef, shapes = nnx.split(attn)[0], nnx.to_pure_dict(nnx.state(attn, nnx.Param))
    axes = {k: v[1:] if v and v[0] == "layers" else v for k, v in logical_axes(attn).items()}
    with jax.set_mesh(mesh):
        # made in their shardings (as whole models' are), so that processes of a device each can join one mesh
        params = filled_params(shapes, tree_shardings(shapes, axes, mesh))
        params = layouts.tensor_parallel_weights({"attn": params}, cfg, mesh)["attn"]  # as the serving layer holds them
        held = scope_held_weights(params, tp)
        weights = (params, held)
        read = scope_read_weights(params, held)  # what the scope's step reads

        def step(weights, x, state):
            params, held = weights
            positions, mask = slot_mask(state, 1)
            layer = {k: v[0] for k, v in state.kv.items()}
            attention, plans = nnx.merge(graphdef, params), dict(state.plans)
            if held is None:
                heads, layer = attention.write_and_attend(x, positions, layer, mask, state.index, plans, absorbed=True)
            else:
                args = (x, positions, layer, mask, state.index, plans)
                heads, layer = serving_block.latent_heads(attention, held, *args, absorbed=True, out_major=False)
            return heads, dataclasses.replace(state, kv={k: v[None] for k, v in layer.items()}, index=state.index + 1)

        options = serving_compiler_options(batch, tp > 1)
        jitted = jax.jit(step, donate_argnums=(2,), compiler_options=options)
        x = filled_like(jax.ShapeDtypeStruct((batch, 1, cfg.n_embd), jnp.bfloat16), batch_sharding(mesh, 3))
        for context in contexts:
            state = init_cache(cfg, batch, context, mesh=mesh)
            kv = refilled(state.kv)
            holder = {"state": dataclasses.replace(state, kv=kv, index=jnp.int32(context - 4 * repeats - 16))}
            del state, kv

            compiled = jitted.lower(weights, x, holder["state"]).compile()
            memory = announced_memory(compiled, "attention", variant, context)

            def run():
                heads, holder["state"] = compiled(weights, x, holder["state"])
                return heads

            timing = time_step(run, repeats)
            rows = batch // dp
            flops = 2 * roofline.matrix_elements(read) * rows
            flops += rows * context * roofline.attention_flops_per_token(cfg, tp)
            cache = roofline.cache_bytes_in_use(holder["state"].kv, context, slot_axis=2)
            timing |= roofline.floor(roofline.shard_bytes(read), cache, flops, ceilings, timing["step_time_s"])
            if STEPS_PER_CALL > 1:
                floor = timing["floor_time_s"]
                timing |= time_layer_calls(step, options, weights, x, holder, batch, context, repeats, floor)
            timing |= roofline.collective_census(compiled.as_text()) | memory
            results.append(_record(variant, "attention", cfg, tp, dp, len(devices), batch, context, timing))
            holder.clear()  # the cache's buffers go before the next context's are made


def scope_held_weights(params: dict[str, jax.Array], tp: int) -> dict[str, jax.Array] | None:
    """The latent family's x_proj, q_up and head-major kv_up as the serving layer holds them on a device that serves
    every block (decode.layouts.attention_weights), for the attention scope to read as serving does: the module as
    trained slices W_UK and W_UV out of kv_up in every step, and XLA copies both (about 22 us a step for MLA). None
    under TP (the scope runs the module's tensor-parallel region) and for the other families."""
    if tp > 1 or not layouts.is_latent(params):
        return None
    return {k: v for k, v in layouts.attention_weights(params, out_major=False).items() if k != "o_proj"}


def scope_read_weights(params: dict[str, jax.Array], held: dict[str, jax.Array] | None) -> dict[str, jax.Array]:
    """The weights the attention scope's step reads (its floor's bytes): all but the output projection and gate, the
    latent projections from their held layouts where it holds them."""
    unread = ("o_proj", "gate_proj", *(layouts.LATENT_HELD if held is not None else ()))
    return {k: v for k, v in params.items() if k not in unread} | (held or {})


def announced_memory(compiled: Any, scope: str, variant: str, context: int) -> dict[str, int]:
    """The compiled step's bytes per device (compiled_memory), printed before it runs: a step that runs out of
    memory leaves what it asked for in the output."""
    memory = compiled_memory(compiled)
    if memory:
        print(
            f"{scope} {variant} at {context} tokens, per device: "
            + ", ".join(f"{k.removesuffix('_bytes')} {v / 1e9:.2f} GB" for k, v in memory.items()),
            flush=True,
        )
    return memory


def measure_model(
    variant: str,
    contexts: list[int],
    repeats: int,
    impl: str,
    devices: list[jax.Device],
    batch: int,
    results: list[dict],
    ceilings: dict[str, float],
) -> None:
    """One decode step of the whole 2.9B model on the serving path per context, appended to results."""
    from mlra_jax.model import abstract_model

    cfg = with_impl(
        dataclasses.replace(
            whole_model(variant), param_dtype="bfloat16", compute_dtype="bfloat16", max_seq_len=max(contexts)
        ),
        impl,
    )
    tp, dp, _ = deployment(variant, len(devices))
    mesh = make_mesh(MeshConfig(data=dp, tensor=tp), devices)
    abstract = abstract_model(cfg)
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    with jax.set_mesh(mesh):
        params = filled_params(shapes, tree_shardings(shapes, logical_axes(abstract), mesh))
        serving = ServingModel(nnx.merge(nnx.split(abstract)[0], params), mesh=mesh, row_kernels=ROW_KERNELS)
        del params
        tokens = jax.device_put(jnp.zeros((batch, 1), jnp.int32), batch_sharding(mesh, 2))
        for context in contexts:
            caches = init_layer_caches(cfg, batch, context, mesh=mesh)
            layers = refilled(caches.layers)
            holder = {"caches": dataclasses.replace(caches, layers=layers, index=jnp.int32(context - 4 * repeats - 16))}
            del caches, layers

            step = serving.compiled(True, tokens.shape).lower(serving.weights, tokens, holder["caches"]).compile()
            memory = announced_memory(step, "model", variant, context)

            def run():
                logits, holder["caches"] = step(serving.weights, tokens, holder["caches"])
                return logits

            timing = time_step(run, repeats)
            weight_bytes, cache_bytes, flops = roofline.model_step_floor(
                cfg, serving.weights, holder["caches"].layers, tp, batch // dp, context
            )
            timing |= roofline.floor(weight_bytes, cache_bytes, flops, ceilings, timing["step_time_s"])
            if STEPS_PER_CALL > 1:
                timing |= time_calls(serving, holder, batch, context, repeats, timing["floor_time_s"], mesh)
            timing |= roofline.collective_census(step.as_text()) | memory
            results.append(_record(variant, "model", cfg, tp, dp, len(devices), batch, context, timing))
            holder.clear()  # the cache's buffers go before the next context's are made


STEPS_PER_CALL = STEPS_PER_GENERATE_CALL  # --steps_per_call


# Calls that time_calls makes beyond the `calls` it dispatches back to back: a warm-up, and on GPUs the profiler's
# warm-ups and its profiled calls
PROFILER_WARMUP, PROFILED_CALLS = 2, 3
EXTRA_CALLS = 1 + PROFILER_WARMUP + PROFILED_CALLS


def calls_slots(steps: int, calls: int) -> int:
    """Cache slots that time_calls writes for `calls` calls of `steps` steps, from the cache's end back."""
    return steps * (calls + EXTRA_CALLS)


def time_calls(
    serving: ServingModel, holder: dict, batch: int, context: int, calls: int, floor: float, mesh: jax.sharding.Mesh
) -> dict[str, Any]:
    """Seconds per step of `generate`'s calls (ServingModel.sampled_steps: STEPS_PER_CALL greedy steps each), `calls`
    of them dispatched back to back, from a cache filled to about `context` tokens; on GPUs also the sum of a call's
    kernels per step (the profiler's, whose span is longer: it slows the host that launches them)."""
    steps = STEPS_PER_CALL
    greedy = jax.jit(functools.partial(sample, temperature=0.0, top_k=0, top_p=1.0))
    tokens = jax.device_put(jnp.zeros((batch,), jnp.int32), batch_sharding(mesh, 1))
    key = jax.random.key(0)
    holder["caches"] = dataclasses.replace(holder["caches"], index=jnp.int32(context - calls_slots(steps, calls)))
    call = serving.compiled(True, (batch, 1), greedy, steps)
    compiled = call.lower(serving.weights, tokens, holder["caches"], key).compile()

    def run():
        drawn, _, holder["caches"] = compiled(serving.weights, tokens, holder["caches"], key)
        return drawn

    return call_timing(run, steps, calls, batch, floor)


def time_layer_calls(
    step: Callable,
    options: dict[str, Any] | None,
    weights: Any,
    x: jax.Array,
    holder: dict,
    batch: int,
    context: int,
    calls: int,
    floor: float,
) -> dict[str, Any]:
    """Seconds per step of the attention scope's layer in calls of STEPS_PER_CALL steps (one program, the steps
    unrolled: each writes its token and attends over the cache), `calls` of them dispatched back to back, as
    time_calls times whole models; a step of this one layer is short enough that dispatching each alone bounds it.
    Every step's output is returned, so that none of their attentions is dead code."""
    steps = STEPS_PER_CALL

    def call(weights, x, state):
        outputs = []
        for _ in range(steps):
            heads, state = step(weights, x, state)
            outputs.append(heads)
        return tuple(outputs), state

    holder["state"] = dataclasses.replace(holder["state"], index=jnp.int32(context - calls_slots(steps, calls)))
    compiled = jax.jit(call, donate_argnums=(2,), compiler_options=options).lower(weights, x, holder["state"]).compile()

    def run():
        outputs, holder["state"] = compiled(weights, x, holder["state"])
        return outputs

    return call_timing(run, steps, calls, batch, floor)


def call_timing(run: Callable[[], Any], steps: int, calls: int, batch: int, floor: float) -> dict[str, Any]:
    """Per-step timing of run(), a call of `steps` steps: `calls` calls dispatched back to back, and on GPUs the
    profiler's span and the sum of a call's kernels per step."""
    seconds = pipelined_time(run, calls) / steps
    timing = {
        "steps_per_call": steps,
        "call_step_s": seconds,
        "call_tokens_per_s": batch / seconds,
        "call_over_floor": seconds / floor,
    }
    if jax.default_backend() == "gpu":
        profiled = profiled_time(run, repeats=PROFILED_CALLS, warmup=PROFILER_WARMUP)
        kernels = roofline.kernel_sum(profiled["kernels_s"])
        timing |= {
            "call_profiled_span_step_s": profiled["time_s"] / steps,
            "call_kernel_sum_step_s": kernels / steps,
            "call_step_over_kernels": seconds * steps / kernels,
            **({"call_timeline": profiled["timeline"]} if KEEP_TIMELINE else {}),
        }
    return timing


def _record(
    variant: str,
    scope: str,
    cfg: ModelConfig,
    tp: int,
    dp: int,
    devices: int,
    batch: int,
    context: int,
    timing: dict[str, Any],
) -> dict[str, Any]:
    seconds = timing["step_time_s"]
    kernels = f"  kernels {timing['kernel_sum_s'] * 1e3:7.3f} ms" if "kernel_sum_s" in timing else ""
    if "call_step_s" in timing:
        kernels += f"  {timing['steps_per_call']} steps per call {timing['call_step_s'] * 1e3:7.3f} ms"
    if "call_kernel_sum_step_s" in timing:
        kernels += f" (kernels {timing['call_kernel_sum_step_s'] * 1e3:.3f})"
    print(
        f"{scope:9} {variant:6} TP={tp} DP={dp} B={batch:<4} ctx={context:<6} {cfg.attention_impl:6} "
        f"{seconds * 1e3:8.3f} ms  {batch / seconds:12,.0f} tokens/s  floor {timing['floor_time_s'] * 1e3:7.3f} ms "
        f"({timing['time_over_floor']:.2f}x){kernels}  collectives {timing['collectives']}",
        flush=True,
    )
    return {
        "scope": scope,
        "variant": variant,
        "tp": tp,
        "dp": dp,
        "devices": devices,
        "batch": batch,
        "context": context,
        "attention_impl": cfg.attention_impl,
        **timing,
        "tokens_per_s": batch / seconds,
        "floor_tokens_per_s": batch / timing["floor_time_s"],
    }


MEASURE = {"attention": measure_attention, "model": measure_model}


def earlier_throughput(
    path: Path, scopes: list[str], variants: list[str], contexts: list[int], impl: str
) -> tuple[list[dict], list[dict]]:
    """For --merge: the results in `path` (failures included) of settings this run does not measure, and the
    runs they came from."""

    def remeasured(r: dict) -> bool:
        return (
            r["scope"] in scopes
            and r["variant"] in variants
            and r["attention_impl"] == impl
            and r.get("context") in contexts
        )

    kept, runs, _ = earlier_results(path, remeasured, ("device", "command", "date", "jax_version", "devices_used"))
    return kept, runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlra bench decode_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--variants", default="gqa,mla,gla2,mlra4")
    parser.add_argument("--contexts", default=",".join(map(str, THROUGHPUT_CONTEXTS)))
    parser.add_argument("--scopes", default=",".join(SCOPES), help="attention (one layer, as the paper), model (2.9B)")
    parser.add_argument("--devices", type=int, default=0, help="devices to deploy over (default: all)")
    parser.add_argument("--batch", type=int, default=PAPER_BATCH, help="sequences per step (all devices)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--attention_impl",
        default="auto",
        choices=("auto", "xla", "pallas"),
        help="the latent family's and GQA's decode attention (auto: the Pallas kernels where they run)",
    )
    parser.add_argument(
        "--tp_reduce",
        default=tensor_parallel.DECODE_REDUCE_DTYPE,
        choices=("compute", "float32"),
        help="the dtype of the latent branches' reductions over `tensor` in decode steps (tensor_parallel)",
    )
    parser.add_argument(
        "--tp_output",
        default="block" if region_block.REGION_BLOCKS else "in_region",
        choices=("block", "in_region", "row_parallel"),
        help="the latent family's serving steps under TP (scope model): each block as one region over each device's "
        "own weights (decode.region_block), or the modules as trained with MLRA's output projection in the "
        "attention's region (one all-reduce) or row-parallel after a reduce-scatter of the heads "
        "(decode.layouts.PROJECT_IN_REGION)",
    )
    parser.add_argument(
        "--absorbed_weights",
        default="folded" if region_block.FOLD_ABSORBED else "separate",
        choices=("folded", "separate"),
        help="scope model, latent blocks under TP (--tp_output=block): decode steps on W_UK folded into q_up and "
        "W_UV into o_proj where a device serves one block of rank <= d_h (decode.region_block.folds), or on them apart",
    )
    parser.add_argument(
        "--row_kernels",
        default=ROW_KERNELS,
        choices=("auto", "off"),
        help="scope model, batch 1 on one device: decode steps on the row-product kernels where they run (as "
        "generate runs them), or on XLA",
    )
    parser.add_argument(
        "--tp_all_reduce",
        default="peer" if peer_exchange.PEER_ALL_REDUCE else serving.TP_ALL_REDUCE,
        choices=("peer", "nccl", "one_shot"),
        help="how decode steps under TP all-reduce the hidden state on GPUs: our kernel that reads the peers' "
        "partials where a group's GPUs share a host (mlra_jax.peer_exchange; NCCL elsewhere), NCCL, or XLA's "
        "one-shot kernel (decode.serving)",
    )
    parser.add_argument(
        "--steps_per_call",
        type=int,
        default=STEPS_PER_GENERATE_CALL,
        help="also time calls of this many decode steps (scope model: steps that sample, as `generate` makes "
        "them; scope attention: the layer's steps in one program) (1: single steps only)",
    )
    parser.add_argument("--copy_gb", type=float, default=2.0, help="size of the bandwidth-reference copy")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="keep each GPU row's median step (and a call of --steps_per_call steps) as its kernels on device 0 (name, "
        "start and duration in us)",
    )
    parser.add_argument(
        "--no_isolate",
        dest="isolate",
        action="store_false",
        help="measure every (scope, variant) in this process (default: a process each)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes to measure in, one device each (jax.distributed on this host); 1: this process drives all",
    )
    parser.add_argument("--process_id", type=int, help=argparse.SUPPRESS)  # set by --processes for its children
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)  # host:port of process 0's coordination service
    parser.add_argument("--cpu", action="store_true", help="measure a CPU anyway (tiny models in the tests)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/decode_throughput.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the results in --out of the settings this run does not measure (with its runs)",
    )
    return parser


def accelerator_present() -> bool:
    """Whether JAX's default backend here is a GPU or a TPU, asked without starting a backend in this process where
    the study runs in processes of their own (a started GPU backend would hold the memory the children need)."""
    code = "import jax, sys; sys.exit(jax.default_backend() == 'cpu')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def child_argv(args: argparse.Namespace, scope: str, variant: str, out: Path) -> list[str]:
    """The command line of the process that measures one (scope, variant) of this run."""
    return [
        sys.executable,
        "-m",
        "mlra_jax.benchmarks.decode_throughput",
        f"--variants={variant}",
        f"--scopes={scope}",
        f"--contexts={args.contexts}",
        f"--devices={args.devices}",
        f"--batch={args.batch}",
        f"--repeats={args.repeats}",
        f"--attention_impl={args.attention_impl}",
        f"--tp_reduce={args.tp_reduce}",
        f"--tp_output={args.tp_output}",
        f"--tp_all_reduce={args.tp_all_reduce}",
        f"--absorbed_weights={args.absorbed_weights}",
        f"--row_kernels={args.row_kernels}",
        f"--copy_gb={args.copy_gb}",
        f"--steps_per_call={args.steps_per_call}",
        *(["--timeline"] if args.timeline else []),
        f"--processes={args.processes}",
        "--no_isolate",
        f"--out={out}",
        *(["--cpu"] if args.cpu else []),
    ]


def measure_isolated(args: argparse.Namespace, scopes: list[str], variants: list[str]) -> int:
    """Each (scope, variant) in a process of its own; their rows (or the failure of a process that saved none)
    gathered into --out, rewritten after each process. This process never starts a backend: the children have the
    devices to themselves."""
    contexts = [int(c) for c in args.contexts.split(",")]
    results, runs = (
        earlier_throughput(args.out, scopes, variants, contexts, args.attention_impl) if args.merge else ([], [])
    )
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for scope in scopes:
            for variant in variants:
                out = Path(folder) / f"{scope}_{variant}.json"
                code = subprocess.run(child_argv(args, scope, variant, out)).returncode
                if out.exists():
                    child = json.loads(out.read_text())
                    results += child["results"]
                    record = record or {k: v for k, v in child.items() if k not in ("results", "runs")}
                if code != 0:
                    error = f"the measuring process exited with {code}"
                    results.append(
                        {"scope": scope, "variant": variant, "attention_impl": args.attention_impl, "error": error}
                    )
                    print(f"{scope} {variant}: failed: {error}", flush=True)
                if record:
                    _save_gathered(args.out, record, runs, results)
    if not record:
        print("error: no process measured anything", file=sys.stderr)
        return 1
    print(f"saved {args.out} ({record['device']} x{record.get('devices_used')})")
    return 0


def _save_gathered(path: Path, record: dict[str, Any], runs: list[dict], results: list[dict]) -> None:
    keys = ("device", "command", "date", "jax_version", "devices_used")
    command = " ".join(["python -m mlra_jax.benchmarks.decode_throughput", *sys.argv[1:]])
    gathered = {**record, "command": command, "runs": [*runs, {**{k: record.get(k) for k in keys}, "command": command}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**gathered, "results": results}, indent=1) + "\n")


PROCESS_COMMAND = [sys.executable, "-m", "mlra_jax.benchmarks.decode_throughput"]  # what --processes starts


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure_in_processes(args: argparse.Namespace, argv: list[str]) -> int:
    """This run in args.processes processes of one GPU each (CUDA_VISIBLE_DEVICES), joined by jax.distributed
    through a coordinator on this host; process 0 writes --out. This process starts no backend."""
    coordinator = f"127.0.0.1:{free_port()}"
    children = []
    for rank in range(args.processes):
        env = dict(os.environ)
        if not args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        children.append(
            subprocess.Popen(
                [*PROCESS_COMMAND, *argv, f"--process_id={rank}", f"--coordinator={coordinator}"],
                env=env,
                stdout=None if rank == 0 else subprocess.DEVNULL,  # process 0 prints the rows
            )
        )
    codes = [child.wait() for child in children]
    return next((code for code in codes if code), 0)


def join_processes(args: argparse.Namespace) -> None:
    """Start this process's part of a --processes run (jax.distributed; on CPUs with gloo's collectives)."""
    if args.cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=args.process_id)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not args.cpu and not accelerator_present():
        parser.error("the study measures GPUs or TPUs (minutes of meaningless work on a CPU); --cpu measures it anyway")
    logging.basicConfig(level=logging.WARNING)
    scopes = args.scopes.split(",")
    if set(scopes) - set(SCOPES):
        parser.error(f"--scopes={args.scopes}: choose from {', '.join(SCOPES)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    variants = args.variants.split(",")
    slots = calls_slots(args.steps_per_call, args.repeats)
    if args.steps_per_call < 1 or (args.steps_per_call > 1 and min(contexts) <= slots):
        parser.error(
            f"--steps_per_call={args.steps_per_call}: give at least 1, and a --contexts above "
            f"steps_per_call x (repeats + {EXTRA_CALLS}) = {slots} (or --steps_per_call=1)"
        )
    if args.processes < 1 or (args.process_id is not None and not args.coordinator):
        parser.error(f"--processes={args.processes}: give at least 1 (--process_id comes with --coordinator)")
    if args.isolate and len(scopes) * len(variants) > 1:
        return measure_isolated(args, scopes, variants)
    if args.processes > 1 and args.process_id is None:
        return measure_in_processes(args, argv)
    if args.process_id is not None:
        join_processes(args)
    devices = jax.devices()[: args.devices or None]
    if args.devices > len(jax.devices()):
        parser.error(f"--devices={args.devices}: only {len(jax.devices())} devices are present")
    tensor_parallel.DECODE_REDUCE_DTYPE = args.tp_reduce
    global STEPS_PER_CALL
    STEPS_PER_CALL = args.steps_per_call
    region_block.REGION_BLOCKS = args.tp_output == "block"
    region_block.FOLD_ABSORBED = args.absorbed_weights == "folded"
    layouts.PROJECT_IN_REGION = args.tp_output == "in_region"
    peer_exchange.PEER_ALL_REDUCE = args.tp_all_reduce == "peer"
    serving.TP_ALL_REDUCE = "nccl" if args.tp_all_reduce == "peer" else args.tp_all_reduce
    global ROW_KERNELS
    ROW_KERNELS = args.row_kernels
    global KEEP_TIMELINE
    KEEP_TIMELINE = args.timeline
    results, runs = (
        earlier_throughput(args.out, scopes, variants, contexts, args.attention_impl) if args.merge else ([], [])
    )
    ceilings = roofline.measured_ceilings(args.copy_gb)
    print(
        f"copy {ceilings['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    extra = {
        "devices_used": len(devices),
        "tp_reduce": args.tp_reduce,
        "tp_output": args.tp_output,
        "tp_all_reduce": args.tp_all_reduce,
        "absorbed_weights": args.absorbed_weights,
        "row_kernels": args.row_kernels,
        "processes": args.processes,
        "ceilings": ceilings,
        "runs": [*runs, {**environment(), "devices_used": len(devices)}],
    }
    for scope in scopes:
        for variant in variants:
            before = len(results)
            try:
                MEASURE[scope](
                    variant, contexts, args.repeats, args.attention_impl, devices, args.batch, results, ceilings
                )
            except Exception as err:  # noqa: BLE001 - record it (the contexts measured before it stay) and go on
                message = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                measured = {r["context"] for r in results[before:]}
                failed = next((c for c in contexts if c not in measured), None)
                results.append(
                    {
                        "scope": scope,
                        "variant": variant,
                        "attention_impl": args.attention_impl,
                        "context": failed,
                        "error": message,
                    }
                )
                print(f"{scope} {variant} at {failed} tokens: failed: {message}", flush=True)
            if jax.process_index() == 0:
                save(args.out, "decode_throughput", results, **extra)
    if jax.process_index() == 0:
        record = save(args.out, "decode_throughput", results, **extra)
        print(f"saved {args.out} ({record['device']} x{len(devices)})")
    if args.process_id is not None:
        jax.distributed.shutdown()  # a barrier: process 0's coordinator outlives the others
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
