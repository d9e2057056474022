"""Training throughput: tokens/s, step time, MFU, device memory and the attention kernels chosen.

    # (a) the 8-layer proxy of each 2.9B experiment on one GPU, batch (and --remat) tried
    mlra bench train --n_layer=8 --batch_per_device=8,12 --out=experiments/results/train_h100.json
    # (b) full 24-layer models with FSDP at the paper's global batch (480 x 2048 through accumulation)
    mlra bench train --experiments=mlra4_2p9b,mla_2p9b --n_layer=24 --fsdp \\
        --global_batch=480 --batch_per_device=auto
    # (c) tensor parallelism: TP degrees over all devices, the rest data parallel
    mlra bench train --experiments=mlra4_2p9b --tp=1,2,4
    # (d) beside the official PyTorch code timed on the same GPU (the JSON lines of its anchor script)
    mlra bench train --experiments=mlra4_2p9b,mla_2p9b --batch_per_device=8,12 \\
        --reference=ref.jsonl

Each setting runs the real jitted train step (AdamW, bf16 compute, the trainer's shardings)
on random tokens; the time is the median wall time of --steps steps after --warmup steps.
MFU = training_flops_per_token x tokens/s / (devices x the chip's dense bf16 peak), with
training_flops_per_token = 3 x (2 x matmul parameters + layers x attention), the attention
core counting 2 (d_qk + d_v) FLOPs per head per visible key, (seq_len + 1) / 2 keys on
average under the causal mask (`mlra_jax.metrics`). Memory: XLA's compiled-step accounting
(arguments + temporaries) and, on GPUs, the allocator's peak so far in this process;
--profile adds the GPU time of one step by kernel family and the longest kernels (--profile_kernels). With
--reference, each result records the official code's best batch for the same variant and
layer count and our tokens/s over it (`reference`; benchmarks.reference). On NVIDIA GPUs each result
records the SM clock, power draw and temperature during its timed steps (`gpu_clocks`,
benchmarks.gpu_clocks): a power-capped GPU slows as it heats, so a few steps after a compile can run
faster than sustained training; --warmup_s=60 runs untimed steps for a minute first, near that steady state.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from mlra_jax.benchmarks.reference import AnchorFileError, compare, read_reference
from mlra_jax.variants import VARIANTS
from mlra_jax.xla_flags import apply_gpu_defaults


def per_device_batches(text: str) -> list[int]:
    """--batch_per_device's list; auto as 0."""
    return [0 if item == "auto" else int(item) for item in text.split(",")]


def setting_overrides(args: argparse.Namespace, devices: int, tp: int, remat: str, per_device: int) -> list[str]:
    """Overrides that turn an experiment into one benchmark setting."""
    replicas = devices // tp
    micro = per_device * replicas
    global_batch = args.global_batch or micro
    if not per_device:  # auto: the trainer's micro-batch (train.max_micro_batch_per_device and remat=auto)
        if not args.global_batch:
            raise ValueError("--batch_per_device=auto needs --global_batch")
    elif global_batch % micro:
        raise ValueError(
            f"--global_batch={global_batch} is not a multiple of the micro-batch {micro} "
            f"({per_device} per device x {replicas} replicas)"
        )
    mesh = ["--mesh.data=1", f"--mesh.fsdp={replicas}"] if args.fsdp else [f"--mesh.data={replicas}", "--mesh.fsdp=1"]
    layers = [f"--model.n_layer={args.n_layer}"] if args.n_layer else []
    remat_override = [f"--model.remat={remat}"] if remat else []
    return [
        *layers,
        f"--model.attention_impl={args.attention_impl}",
        *remat_override,
        f"--train.seq_len={args.seq_len}",
        f"--train.global_batch_size={global_batch}",
        *([f"--train.micro_batch_size={micro}"] if per_device else []),
        f"--train.loss_chunk={args.loss_chunk}",
        *mesh,
        f"--mesh.tensor={tp}",
        *args.override,
    ]


def random_tokens(setup: Any) -> Any:
    """A benchmark's batch: random tokens [global batch, seq_len + 1], placed over the mesh as the trainer places
    its batches."""
    import jax
    import jax.numpy as jnp

    from mlra_jax.training.state import global_batch

    train, cfg = setup.experiment.train, setup.experiment.model
    tokens = jax.random.randint(
        jax.random.key(0), (train.global_batch_size, train.seq_len + 1), 0, cfg.vocab_size, dtype=jnp.int32
    )
    return global_batch(setup, jax.device_get(tokens))


def top_kernels(kernels_s: dict[str, float], count: int = 25) -> dict[str, Any]:
    """The step's GPU time by kernel family (matmuls, attention, fusions, ...) and its `count` longest kernels. The
    training step's Mosaic GPU kernels are our MLRA attention's (forward, dK/dV and dQ)."""
    families = {
        "attention": ("sdpa", "fmha", "flash", "cudnn", "mosaic_gpu"),
        "matmul": ("gemm", "xmma", "cutlass", "matmul", "nvjet"),
        "collective": ("nccl", "all_gather", "reduce_scatter", "all_reduce"),
        "copy": ("memcpy", "memset"),
    }
    by_family: dict[str, float] = {}
    for name, seconds in kernels_s.items():
        lower = name.lower()
        family = next((f for f, keys in families.items() if any(k in lower for k in keys)), "other (fusions)")
        by_family[family] = by_family.get(family, 0.0) + seconds
    longest = sorted(kernels_s.items(), key=lambda item: -item[1])[:count]
    return {"by_family_s": by_family, "longest_s": dict(longest)}


def gemm_calls(hlo_text: str) -> dict[str, int]:
    """The cuBLAS GEMM calls of a compiled GPU program by kind (`fp8` for __cublas$lt$matmul$f8)."""
    calls = re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo_text)
    return {"fp8": sum(c.endswith("$f8") for c in calls), "other": sum(not c.endswith("$f8") for c in calls)}


def measure(
    name: str, overrides: list[str], steps: int, profile: int = 0, warmup: int = 2, warmup_s: float = 0.0
) -> dict[str, Any]:
    """One setting's result: `warmup` untimed steps, more until `warmup_s` seconds have passed since the first,
    then the median of `steps` timed steps; with `profile` > 0, one profiled step's GPU time by kernel family and
    its `profile` longest kernels."""
    import jax

    from mlra_jax.attention import fused
    from mlra_jax.benchmarks.common import median_time, profiled_time
    from mlra_jax.benchmarks.gpu_clocks import ClockSampler
    from mlra_jax.cli import apply_overrides
    from mlra_jax.experiments import get_experiment
    from mlra_jax.metrics import peak_flops, training_flops_per_token
    from mlra_jax.training.state import build_setup, fsdp_gather, init_state, jit_train_step

    requested = apply_overrides(get_experiment(name), overrides)
    setup = build_setup(requested)
    train, cfg = setup.experiment.train, setup.experiment.model
    with jax.set_mesh(setup.mesh), fused.kernels_chosen() as chosen:
        state = init_state(setup)
        tokens = random_tokens(setup)
        start = time.perf_counter()
        compiled = jit_train_step(setup).lower(state["params"], state["opt_state"], state["fp8"], tokens).compile()
        compile_s = time.perf_counter() - start
        gemms = gemm_calls(compiled.as_text())
        analysis = compiled.memory_analysis()

        def run():
            state["params"], state["opt_state"], state["fp8"], metrics = compiled(
                state["params"], state["opt_state"], state["fp8"], tokens
            )
            return metrics["loss"]

        warmed, started = 0, time.perf_counter()
        while warmed < warmup or time.perf_counter() - started < warmup_s:
            jax.block_until_ready(run())
            warmed += 1
        with ClockSampler() as clocks:
            seconds = median_time(run, repeats=steps, warmup=0)
        kernels = top_kernels(profiled_time(run, repeats=1)["kernels_s"], profile) if profile else None
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    tokens_per_s = train.global_batch_size * train.seq_len / seconds
    peak = peak_flops(device)
    flops = training_flops_per_token(cfg, train.seq_len)
    devices = setup.mesh.size
    micro = train.global_batch_size // train.accumulation_steps
    return {
        "experiment": name,
        "variant": cfg.variant,
        "n_layer": cfg.n_layer,
        "parameters": setup.num_params,
        "mesh": dict(setup.mesh.shape),
        "global_batch": train.global_batch_size,
        "micro_batch": micro,
        "batch_per_device": micro // (devices // setup.mesh.shape["tensor"]),
        "accumulation_steps": train.accumulation_steps,
        "seq_len": train.seq_len,
        "attention_impl": cfg.attention_impl,
        "kernels": chosen,
        "gemms": gemms,
        "remat": cfg.remat,
        "remat_setting": requested.model.remat,
        "fsdp_gather": fsdp_gather(setup),  # where FSDP gathers the weights under accumulation (None: no FSDP)
        "latent_form": cfg.latent_form,
        # the absorbed form where it ran: always (trains_absorbed), or under "auto" on the MLRA kernel's calls
        "trains_absorbed": cfg.trains_absorbed or (cfg.latent_form == "auto" and chosen.get("mlra_kernel", 0) > 0),
        "latent_keys": cfg.latent_keys,
        "loss_chunk": train.loss_chunk,
        "scan_layers": cfg.scan_layers,
        "compile_s": compile_s,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "warmup_steps": warmed,  # untimed steps before the timed ones (--warmup, or more to fill --warmup_s)
        "step_time_s": seconds,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / devices,
        "flops_per_token": flops,
        "mfu": flops * tokens_per_s / (peak * devices) if peak else None,
        "compiled_bytes": (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes) if analysis else None,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "gpu_clocks": clocks.summary,  # the timed steps' SM clock, power and temperature (nvidia-smi)
        "profile": kernels,
    }


def describe(result: dict[str, Any]) -> str:
    head = (
        f"{result['experiment']:16} mesh={result['mesh']} b/dev={result['batch_per_device']} remat={result['remat']:9}"
    )
    if "error" in result:
        return f"{head} error: {result['error'][:160]}"
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a"
    memory = result["compiled_bytes"] or 0
    line = (
        f"{head} {result['tokens_per_s']:10,.0f} tok/s  step {result['step_time_s'] * 1e3:8.1f} ms  MFU {mfu}"
        f"  mem {memory / 2**30:.1f} GiB  kernels {result['kernels']}"
    )
    clocks = result.get("gpu_clocks")
    if clocks:
        line += f"  SM {clocks['sm_clock_mhz']['median']:.0f} MHz"
    ref = result.get("reference")
    if ref:
        other = "" if ref["same_device"] else f" on {ref['device']}"
        line += f"  REF {ref['tokens_per_s']:,.0f} (batch {ref['best_batch']}{other}): {ref['ratio']:.2f}x"
    return line


def mark_best(results: list[dict[str, Any]]) -> None:
    """Mark each experiment's fastest setting `best`."""
    for result in results:
        result.pop("best", None)
    for name in {r["experiment"] for r in results}:
        finished = [r for r in results if r["experiment"] == name and "error" not in r]
        if finished:
            max(finished, key=lambda r: r["tokens_per_s"])["best"] = True


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line; its defaults are the setting other benchmarks time too (benchmarks.interleaved)."""
    parser = argparse.ArgumentParser(
        prog="mlra bench train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--experiments", default=",".join(f"{v}_2p9b" for v in VARIANTS))
    parser.add_argument("--n_layer", type=int, default=8, help="layers (0: the experiment's own)")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument(
        "--batch_per_device",
        default="4",
        help="sequences per data-parallel replica per micro-batch "
        "(a list is tried in turn; the fastest is marked best); auto: the trainer's own choice under "
        "--global_batch (train.max_micro_batch_per_device, fewer where remat=auto takes a smaller one)",
    )
    parser.add_argument(
        "--global_batch",
        type=int,
        default=0,
        help="sequences per optimizer step, reached by accumulation (0: one micro-batch)",
    )
    parser.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state over the replicas")
    parser.add_argument("--tp", default="1", help="TP degrees (the other devices are data parallel)")
    parser.add_argument("--attention_impl", default="auto", choices=("auto", "xla", "cudnn", "splash"))
    parser.add_argument(
        "--remat",
        default="",
        help="remat policies to try (none, full, dots, dots_attn, auto; default: the experiment's own)",
    )
    parser.add_argument("--loss_chunk", type=int, default=512, help="cross-entropy chunk in positions (0: whole)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the step is compiled before)")
    parser.add_argument(
        "--warmup_s",
        type=float,
        default=0.0,
        help="also run untimed steps until this many seconds have passed (60: a GPU hot as in sustained training)",
    )
    parser.add_argument("--profile", action="store_true", help="also record GPU time by kernel (one profiled step)")
    parser.add_argument(
        "--profile_kernels", type=int, default=25, help="with --profile: how many of the longest kernels it lists"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="any experiment override, e.g. --override=--model.scan_layers=false (repeatable)",
    )
    parser.add_argument("--no_xla_defaults", action="store_true", help="leave out mlra_jax.xla_flags' GPU flags")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"the JSON record (default: {CHECKOUT_RECORD} where that folder exists, as in a checkout of this "
        f"repository; else {LOCAL_RECORD} in the current folder)",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        help="the official code's figures: the JSON lines its anchor "
        "script printed on the same GPU (each result records REF's best batch and the ratio)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the results already in --out for the experiments this run does not measure",
    )
    return parser


CHECKOUT_RECORD = Path("experiments/results/train.json")  # where the repository keeps its records
LOCAL_RECORD = Path("bench_train.json")


def default_record() -> Path:
    """--out's default: the repository's record in a checkout (its folder exists), else a file in the current folder
    (never a checkout-shaped folder made for it)."""
    return CHECKOUT_RECORD if CHECKOUT_RECORD.parent.is_dir() else LOCAL_RECORD


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.out = args.out or default_record()
    try:
        reference = read_reference(args.reference) if args.reference else None
    except AnchorFileError as err:
        parser.error(str(err))
    try:
        batches = per_device_batches(args.batch_per_device)
    except ValueError:
        parser.error(f"--batch_per_device={args.batch_per_device!r} is not a list of integers and 'auto'")
    if 0 in batches and not args.global_batch:
        parser.error("--batch_per_device=auto needs --global_batch (the trainer splits it into micro-batches)")
    if args.profile_kernels < 1:
        parser.error(f"--profile_kernels={args.profile_kernels} lists no kernel; give 1 or more (25 by default)")
    xla_defaults = False if args.no_xla_defaults else apply_gpu_defaults()  # before JAX starts a backend
    logging.basicConfig(level=logging.WARNING)

    import jax

    from mlra_jax.benchmarks.common import earlier_results, environment, experiment_list, save
    from mlra_jax.experiments import get_experiment

    names = experiment_list(parser, args.experiments)
    planned = {
        (name, per_device, remat or get_experiment(name).model.remat, tp)
        for name in names
        for per_device in batches
        for remat in args.remat.split(",")
        for tp in map(int, args.tp.split(","))
    }
    remeasured = lambda r: (
        (
            r["experiment"],
            0 if r.get("batch_per_device_setting") == "auto" else r["batch_per_device"],
            r.get("remat_setting", r["remat"]),
            r["mesh"]["tensor"],
        )
        in planned
    )
    results, runs, _ = earlier_results(args.out, remeasured) if args.merge else ([], [], {})
    failures: list[Exception] = []
    extra = {
        "xla_gpu_defaults": xla_defaults,
        "runs": [*runs, environment()],
        **({"reference_file": str(args.reference)} if args.reference else {}),
    }
    for name in names:
        for tp in map(int, args.tp.split(",")):
            for remat in args.remat.split(","):
                for per_device in batches:
                    try:
                        result = measure(
                            name,
                            setting_overrides(args, jax.device_count(), tp, remat, per_device),
                            args.steps,
                            args.profile_kernels if args.profile else 0,
                            args.warmup,
                            args.warmup_s,
                        )
                    except Exception as err:  # noqa: BLE001 - out of memory and the like: record it and go on
                        failures.append(err)
                        result = {
                            "experiment": name,
                            "mesh": {"tensor": tp},
                            "batch_per_device": per_device,
                            "remat": remat or "default",
                            "error": f"{type(err).__name__}: {err}",
                        }
                    result["batch_per_device_setting"] = per_device or "auto"
                    if reference and "error" not in result:
                        result["reference"] = compare(
                            result, get_experiment(name).reference_key, jax.devices()[0].device_kind, reference
                        )
                    gc.collect()
                    print(describe(result), flush=True)
                    results.append(result)
                    save(args.out, "train", results, **extra)
    mark_best(results)
    record = save(args.out, "train", results, **extra)
    settings = len(names) * len(args.tp.split(",")) * len(args.remat.split(",")) * len(batches)
    if len(failures) == settings:  # nothing measured: the exit code of the first failure (2 for bad input)
        from mlra_jax.command import exit_code

        code, message = exit_code(failures[0])
        print(
            f"error: none of the {settings} settings was measured (errors in {args.out}); the first: {message}",
            file=sys.stderr,
        )
        return code
    print(f"saved {args.out} ({record['device']} x{record['device_count']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
