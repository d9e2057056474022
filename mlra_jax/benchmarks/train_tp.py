"""Training-step throughput with and without tensor parallelism.

    python -m mlra_jax.benchmarks.train_tp --experiments=mlra4_2p9b,mla_2p9b --n_layer=8 --tp=1,2,4 \\
        --out=experiments/results/train_tp.json

Each configuration runs the real train step (bf16 compute, AdamW, the paper's widths,
`--n_layer` layers) on synthetic tokens over all devices, as DP x TP meshes with TP
from `--tp`; it reports tokens/s, step time and MFU (median of --steps timed steps).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import get_experiment
from mlra_jax.benchmarks.common import median_time, save
from mlra_jax.cli import apply_overrides
from mlra_jax.metrics import peak_flops, training_flops_per_token
from mlra_jax.trainer import global_batch, jit_train_step, build_setup, init_state


def measure(name: str, tp: int, args: argparse.Namespace) -> dict:
    devices = jax.device_count()
    experiment = apply_overrides(get_experiment(name), [
        f"--model.n_layer={args.n_layer}", f"--model.attention_impl={args.attention_impl}",
        f"--model.remat={args.remat}", f"--train.seq_len={args.seq_len}",
        f"--train.global_batch_size={args.batch_per_replica * devices // tp}", "--train.micro_batch_size=none",
        f"--mesh.data={devices // tp}", "--mesh.fsdp=1", f"--mesh.tensor={tp}"])
    setup = build_setup(experiment)
    with jax.set_mesh(setup.mesh):
        state = init_state(setup)
        step = jit_train_step(setup)
        batch = experiment.train.global_batch_size
        tokens = jax.random.randint(jax.random.key(0), (batch, args.seq_len + 1), 0, 50257, dtype=jnp.int32)
        tokens = global_batch(setup, jax.device_get(tokens))

        def run():
            state["params"], state["opt_state"], metrics = step(state["params"], state["opt_state"], tokens)
            return metrics["loss"]

        seconds = median_time(run, repeats=args.steps)
    tokens_per_s = batch * args.seq_len / seconds
    peak = peak_flops(jax.devices()[0])
    flops = training_flops_per_token(experiment.model, args.seq_len)
    return {"experiment": name, "variant": experiment.model.variant, "n_layer": args.n_layer, "tp": tp,
            "mesh": dict(setup.mesh.shape), "global_batch": batch, "seq_len": args.seq_len,
            "attention_impl": args.attention_impl, "remat": args.remat, "step_time_s": seconds,
            "tokens_per_s": tokens_per_s,
            "mfu": flops * tokens_per_s / (peak * devices) if peak else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlra_jax.benchmarks.train_tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="mlra4_2p9b,mla_2p9b")
    parser.add_argument("--tp", default="1,2,4", help="TP degrees (the rest of the devices is data parallel)")
    parser.add_argument("--n_layer", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_per_replica", type=int, default=4, help="sequences per data-parallel replica")
    parser.add_argument("--attention_impl", default="xla", choices=("xla", "cudnn"))
    parser.add_argument("--remat", default="dots", choices=("none", "full", "dots"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/train_tp.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = []
    for name in args.experiments.split(","):
        for tp in map(int, args.tp.split(",")):
            result = measure(name, tp, args)
            results.append(result)
            mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a"
            print(f"{name:12} TP={tp} mesh={result['mesh']}  {result['tokens_per_s']:12,.0f} tokens/s  "
                  f"step {result['step_time_s'] * 1e3:8.1f} ms  MFU {mfu}", flush=True)
    record = save(args.out, "train_tp", results)
    print(f"saved {args.out} ({record['device']} x{record['device_count']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
