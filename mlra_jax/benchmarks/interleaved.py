"""Two settings of one training step timed alternately, so that both see the same GPU clocks.

    mlra bench interleaved --experiment=mlra4_2p9b --n_layer=8 --batch_per_device=12 \\
        --a=--model.latent_keys=product --b=--model.latent_keys=concat --pairs=20

A power-capped GPU's clock moves by several percent between runs (benchmarks.gpu_clocks), often more than
what two settings differ by. Here both steps are compiled first; then, on one state (the weights and
optimizer state each step returns feed the next, whichever setting runs it), --warmup untimed pairs and
--pairs timed ones run A then B, B then A, and so on. The record gives each side's median step and tokens/s,
the median over pairs of B's step over A's and how many pairs A won. --a and --b (repeatable) are experiment
overrides that must leave the weights' and the optimizer state's shapes alone (remat, latent forms, kernels,
XLA-visible choices, FP8 attention on or off: each side keeps FP8 amax histories of its own); the rest of the
setting is benchmarks.train's (one micro-batch per step, data parallel over the devices).

    mlra bench interleaved --experiment=gqa_2p9b --n_layer=8 --batch_per_device=12 \
        --a=--model.matmul_dtype=float8 --b=--model.matmul_dtype=float8 --b=--model.fp8_attention=true
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from mlra_jax.benchmarks.train import build_parser, random_tokens, setting_overrides
from mlra_jax.xla_flags import apply_gpu_defaults


def measure(name: str, base: list[str], sides: dict[str, list[str]], pairs: int, warmup: int) -> dict[str, Any]:
    """Each side's step times over `pairs` alternated pairs after `warmup` untimed ones."""
    import jax

    from mlra_jax.cli import apply_overrides
    from mlra_jax.experiments import get_experiment
    from mlra_jax.training.state import build_setup, fresh_fp8_histories, init_state, jit_train_step

    experiment = get_experiment(name)
    setups = {side: build_setup(apply_overrides(experiment, [*base, *extra])) for side, extra in sides.items()}
    first = setups["a"]
    shapes = {
        side: jax.tree.map(lambda x: (x.shape, x.dtype), {k: v for k, v in s.abstract_state.items() if k != "fp8"})
        for side, s in setups.items()
    }
    if shapes["a"] != shapes["b"]:
        raise ValueError("--a and --b give train states of different shapes; compare settings that keep the weights")
    train = first.experiment.train
    with jax.set_mesh(first.mesh):
        state = init_state(first)
        histories = {side: fresh_fp8_histories(s) for side, s in setups.items()}  # each side's own FP8 scales
        tokens = random_tokens(first)
        steps = {
            side: jit_train_step(s).lower(state["params"], state["opt_state"], histories[side], tokens).compile()
            for side, s in setups.items()
        }

        def run(side: str) -> float:
            start = time.perf_counter()
            state["params"], state["opt_state"], histories[side], metrics = steps[side](
                state["params"], state["opt_state"], histories[side], tokens
            )
            jax.block_until_ready(metrics["loss"])
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"a": [], "b": []}
        for pair in range(warmup + pairs):
            for side in ("a", "b") if pair % 2 == 0 else ("b", "a"):
                seconds = run(side)
                if pair >= warmup:
                    times[side].append(seconds)
    tokens_per_step = train.global_batch_size * train.seq_len
    median = {side: statistics.median(t) for side, t in times.items()}
    return {
        "experiment": name,
        "overrides": {"base": base, **sides},
        "pairs": pairs,
        "warmup_pairs": warmup,
        "median_step_s": median,
        "tokens_per_s": {side: tokens_per_step / seconds for side, seconds in median.items()},
        "b_over_a": statistics.median(b / a for a, b in zip(times["a"], times["b"])),
        "pairs_a_won": sum(a < b for a, b in zip(times["a"], times["b"])),
        "step_times_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench interleaved",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--n_layer", type=int, default=8, help="layers (0: the experiment's own)")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_per_device", type=int, default=12)
    parser.add_argument("--a", action="append", default=[], help="setting A's overrides (repeatable)")
    parser.add_argument("--b", action="append", default=[], help="setting B's overrides (repeatable)")
    parser.add_argument("--pairs", type=int, default=20, help="timed pairs")
    parser.add_argument("--warmup", type=int, default=3, help="untimed pairs first (both steps are compiled before)")
    parser.add_argument("--no_xla_defaults", action="store_true", help="leave out mlra_jax.xla_flags' GPU flags")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/interleaved.json"))
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.warmup < 0 or args.batch_per_device < 1:
        parser.error("--pairs and --batch_per_device must be positive and --warmup at least 0")
    if args.a == args.b:
        parser.error("--a and --b are the same setting; give each side the overrides that make it differ")
    xla_defaults = False if args.no_xla_defaults else apply_gpu_defaults()  # before JAX starts a backend
    logging.basicConfig(level=logging.WARNING)

    import jax

    from mlra_jax.benchmarks.common import experiment_list, save
    from mlra_jax.config import ConfigError

    names = experiment_list(parser, args.experiment)
    if len(names) != 1:
        parser.error(f"--experiment takes one experiment; got {len(names)}: {args.experiment}")
    (name,) = names
    # benchmarks.train's defaults: one micro-batch, data parallel over the devices, the experiment's remat
    setting = build_parser().parse_args([f"--n_layer={args.n_layer}", f"--seq_len={args.seq_len}"])
    base = setting_overrides(setting, len(jax.devices()), tp=1, remat="", per_device=args.batch_per_device)
    try:
        result = measure(name, base, {"a": args.a, "b": args.b}, args.pairs, args.warmup)
    except (ConfigError, ValueError) as err:
        parser.error(str(err))
    save(args.out, "interleaved train steps", [result], xla_gpu_defaults=xla_defaults)
    a, b = result["tokens_per_s"]["a"], result["tokens_per_s"]["b"]
    print(
        f"{name}: A {a:,.0f} tok/s, B {b:,.0f} tok/s; B's step / A's {result['b_over_a']:.4f} (median of "
        f"{args.pairs} pairs), A faster in {result['pairs_a_won']} of {args.pairs} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
