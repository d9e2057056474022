"""The update of a train step (clipping, AdamW, the finite checks) against its memory-traffic floor.

    mlra bench optimizer --experiments=mlra4_2p9b --n_layer=8 \\
        --out=experiments/results/optimizer_h100.json

It times `training.step.apply_gradients`, the code the train step runs after the backward, on the parameters
of the experiment's model (float32 weights, AdamW moments and gradients, on one device). One pass over the
state reads the gradients, weights and both moments and writes the weights and moments back (28 bytes per
parameter); the clipping's global norm must read the gradients once before (4 more). `passes` is the measured
time over the time of those 32 bytes per parameter at the bandwidth of a plain copy measured in the same run
(1.0: the update is one pass after the norm). On GPUs the time is the profiler's device time, with each kernel.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

BYTES_PER_PARAMETER = 4 + 28  # the global norm's read of the gradients, then one read-modify-write pass


def measure(name: str, overrides: list[str], steps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from mlra_jax.benchmarks.common import benchmark_params, filled_like, median_time, profiled_time
    from mlra_jax.benchmarks.roofline import copy_bandwidth
    from mlra_jax.cli import apply_overrides
    from mlra_jax.experiments import get_experiment
    from mlra_jax.optim import make_optimizer
    from mlra_jax.training.step import apply_gradients

    experiment = apply_overrides(get_experiment(name), overrides)
    optimizer = make_optimizer(experiment.train)
    params = benchmark_params(experiment.model)
    grads = filled_like(params, scale=1e-3)
    opt_state = jax.jit(optimizer.init)(params)
    count = sum(int(p.size) for p in jax.tree.leaves(params))
    update = jax.jit(lambda p, s, g: apply_gradients(optimizer, p, s, g, jnp.float32(1.0)), donate_argnums=(0, 1))

    def run():
        nonlocal params, opt_state
        params, opt_state, metrics = update(params, opt_state, grads)
        return metrics["finite"]

    on_gpu = jax.devices()[0].platform == "gpu"
    if on_gpu:
        profile = profiled_time(run, repeats=steps)
        seconds, kernels = profile["time_s"], profile["kernels_s"]
    else:
        seconds, kernels = median_time(run, repeats=steps), None
    bandwidth = copy_bandwidth(4 * count / 2**30)  # a copy of as many bytes as the float32 weights
    floor_s = BYTES_PER_PARAMETER * count / bandwidth
    return {
        "experiment": name,
        "n_layer": experiment.model.n_layer,
        "parameters": count,
        "time_s": seconds,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "floor_s": floor_s,
        "passes": seconds / floor_s,
        "kernels": len(kernels) if kernels else None,
        "kernels_s": dict(sorted(kernels.items(), key=lambda item: -item[1])) if kernels else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlra bench optimizer", description=__doc__)
    parser.add_argument("--experiments", default="mlra4_2p9b")
    parser.add_argument("--n_layer", type=int, default=8, help="layers (0: the experiment's own)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/optimizer.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from mlra_jax.benchmarks.common import experiment_list, save

    results = []
    for name in experiment_list(parser, args.experiments):
        overrides = [f"--model.n_layer={args.n_layer}"] if args.n_layer else []
        result = measure(name, overrides, args.steps)
        print(
            f"{name:16} {result['parameters'] / 1e9:.2f}B parameters: update {result['time_s'] * 1e3:.2f} ms, "
            f"floor {result['floor_s'] * 1e3:.2f} ms ({result['passes']:.2f}x), {result['kernels']} kernels",
            flush=True,
        )
        results.append(result)
    save(args.out, "optimizer", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
