"""The paper's experiments compiled for TPU slices on this machine (no TPU needed; libtpu installed).

    # every *_2p9b train step for two slices, at the paper's global batch (480 x 2048)
    mlra bench tpu_compile --train --topologies=v5p-64,v5e-32
    # the serving steps: MLRA-4 at TP=4 (one latent block per chip) and GLA-2 at TP=2, batch 1 and 128
    mlra bench tpu_compile --serving --topologies=v5e-4,v5p-8

Each setting is one `mlra_jax.tpu_compile` report (per-chip memory against HBM, the Mosaic kernels, XLA's
cost analysis, the roofline estimate), saved to --out after each, with the device, command and date. A
setting that does not fit is recorded as such (the compiler's message), not as an error.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

SERVING = (("mlra4_2p9b", 4), ("gla2_2p9b", 2))  # (experiment, TP degree): one latent block per chip for MLRA-4


def describe(row: dict[str, Any]) -> str:
    head = f"{row['experiment']:26} {row['topology']:9} {row['step']:13}"
    if "error" in row and row.get("memory") is None and "fits" not in row:
        return f"{head} error: {row['error'][:200]}"
    memory = f"{row['memory']['total'] / 2**30:6.1f} GiB" if row.get("memory") else "   > HBM"
    estimate = row.get("estimate", {})
    mfu = f"  MFU {estimate['mfu_no_overlap']:.0%}-{estimate['mfu']:.0%}" if "mfu_no_overlap" in estimate else ""
    settings = ", ".join(
        f"{k} {v}" for k, v in row["settings"].items() if k in ("micro-batch", "remat", "tp", "batch", "context")
    )
    return (
        f"{head} {'fits ' if row['fits'] else 'NO FIT'} {memory} of {row['hbm_bytes'] / 2**30:.1f}  "
        f"{settings}  kernels {sorted(row['kernels'])}{mfu}  compile {row['compile_s']:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench tpu_compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--topologies", default="v5p-64,v5e-32", help="TPU slices (tpu_topology names)")
    parser.add_argument("--experiments", default="", help="train steps of these experiments (default: every *_2p9b)")
    parser.add_argument("--train", action="store_true", help="compile the experiments' train steps")
    parser.add_argument(
        "--serving", action="store_true", help="compile the serving steps of MLRA-4 (TP=4) and GLA-2 (TP=2)"
    )
    parser.add_argument("--batches", default="1,128", help="serving batch sizes")
    parser.add_argument("--context", type=int, default=8192, help="serving cache slots per sequence")
    parser.add_argument("--override", action="append", default=[], help="an experiment override (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/tpu_compile.json"))
    args = parser.parse_args(argv)
    if not (args.train or args.serving):
        parser.error("say what to compile: --train, --serving or both")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from mlra_jax.benchmarks.common import save
    from mlra_jax.cli import apply_overrides
    from mlra_jax.config import ConfigError
    from mlra_jax.experiments import experiment_names, get_experiment
    from mlra_jax.guards import error_summary
    from mlra_jax.tpu_compile import compile_serving, compile_train
    from mlra_jax.tpu_topology import parse_topology

    try:
        topologies = [parse_topology(name) for name in args.topologies.split(",")]
    except ConfigError as err:
        parser.error(str(err))
    names = args.experiments.split(",") if args.experiments else [n for n in experiment_names() if n.endswith("_2p9b")]
    rows: list[dict[str, Any]] = []

    def record(experiment: str, row: dict[str, Any]) -> None:
        row = {"experiment": experiment, **row}
        rows.append(row)
        print(describe(row), flush=True)
        save(args.out, "tpu_compile", rows, topologies=[t.slice_name for t in topologies])

    for topology in topologies:
        if args.train:
            for name in names:
                try:
                    report = compile_train(apply_overrides(get_experiment(name), args.override), topology)
                    record(name, report.to_json())
                except Exception as err:  # noqa: BLE001 - a setting that does not compile is recorded; the rest go on
                    record(name, {"topology": topology.slice_name, "step": "train step", "error": error_summary(err)})
        if args.serving:
            for name, tp in SERVING:
                cfg = apply_overrides(get_experiment(name), args.override).model
                for batch in map(int, args.batches.split(",")):
                    try:
                        for report in compile_serving(cfg, topology, tp, batch, args.context):
                            record(name, report.to_json())
                    except Exception as err:  # noqa: BLE001 - as above
                        record(name, {"topology": topology.slice_name, "step": "serving", "error": error_summary(err)})
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
