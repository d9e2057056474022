"""The panel kernels (pallas_kernels.panel_products_gpu) against XLA's GEMMs at the products of a decode step on one
device of the paper's 4-GPU deployments at batch 64: MLRA-4 at TP=4 (64 rows a device), GLA-2 at TP=2 x DP=2
(32), MLA at DP=4 (16), the 2.9B models' weights as each device holds them.

    mlra bench panel_products --out=experiments/results/panel_products_h100.json

Every call reads its own copy of the weight (more bytes than the L2 holds); device time per call is the
profiler's span of all copies over their number (median of --repeats), with the weight's bytes over that time
against the copy bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from mlra_jax.benchmarks.common import filled_like, profiled_time, save
from mlra_jax.benchmarks.roofline import copy_bandwidth
from mlra_jax.decode.serving import serving_compiler_options
from mlra_jax.pallas_kernels.panel_products_gpu import (
    PanelTiling,
    default_tiling,
    panel_matmul,
    panel_problem,
    swiglu_panel_matmul,
)


@dataclasses.dataclass(frozen=True)
class Panel:
    """One product of a decode step on one device: `rows` x [K] times W [K, N] (kind "swiglu": [K, 2, N])."""

    name: str
    rows: int
    k: int
    n: int
    kind: str = "plain"

    def weight_shape(self) -> tuple[int, ...]:
        return (self.k, 2, self.n) if self.kind == "swiglu" else (self.k, self.n)

    def weight_bytes(self) -> int:
        return 2 * math.prod(self.weight_shape())


def deployment_panels(name: str, rows: int, q_rank: int, x_width: int, heads: int, f: int) -> list[Panel]:
    return [
        Panel(f"x_proj ({name})", rows, 3072, x_width),
        Panel(f"q_up ({name})", rows, q_rank, heads * 192),
        Panel(f"o_proj ({name})", rows, heads * 128, 3072),
        Panel(f"gate_up ({name})", rows, 3072, f, "swiglu"),
        Panel(f"down ({name})", rows, f, 3072),
    ]


PANELS = (
    *deployment_panels("MLRA-4 TP=4", 64, 1024, 1024 + 128 + 64, 24, 2496),
    *deployment_panels("GLA-2 TP=2", 32, 1024, 1024 + 256 + 64, 12, 5056),
    *deployment_panels("MLA DP=4", 16, 1536, 1536 + 512 + 64, 24, 9472),
)
SWEEP = tuple(
    PanelTiling(block_n=n, block_k=k, split_k=s, num_stages=stages)
    for n, k, s, stages in itertools.product((32, 64, 128), (128, 256), (1, 2, 3, 4, 8), (4,))
)


def kernel_call(panel: Panel, tiling: PanelTiling) -> Callable:
    if panel.kind == "swiglu":
        return lambda x, w: swiglu_panel_matmul(x, w, tiling=tiling)
    return lambda x, w: panel_matmul(x, w, tiling=tiling)


def xla_call(panel: Panel) -> Callable:
    """The product as the serving path runs it on XLA: the GEMM, then (SwiGLU) silu(gate) * up."""
    if panel.kind == "swiglu":

        def swiglu(x, w):
            both = jnp.einsum("mk,kgn->gmn", x, w)
            return jax.nn.silu(both[0]) * both[1]

        return swiglu
    return lambda x, w: jnp.einsum("mk,kn->mn", x, w)


def time_copies(call: Callable, x: jax.Array, weights: list[jax.Array], repeats: int) -> dict:
    run = jax.jit(lambda x, ws: [call(x, w) for w in ws], compiler_options=serving_compiler_options(x.shape[0]))
    timing = profiled_time(lambda: run(x, weights), repeats)
    top = sorted(timing["kernels_s"].items(), key=lambda kv: -kv[1])[:4]
    return {"time_s": timing["time_s"] / len(weights), "kernels_s": {k: v / len(weights) for k, v in top}}


def measure(panel: Panel, tilings: list[PanelTiling], repeats: int, bandwidth: float) -> dict:
    copies = min(32, max(2, math.ceil(256e6 / panel.weight_bytes())))
    x = jax.random.normal(jax.random.key(0), (panel.rows, panel.k)).astype(jnp.bfloat16)
    weights = filled_like([jax.ShapeDtypeStruct(panel.weight_shape(), jnp.bfloat16)] * copies, scale=0.02)
    floor = panel.weight_bytes() / bandwidth

    def line(label: str, seconds: float) -> str:
        return f"{panel.name:20} {label:34} {seconds * 1e6:7.2f} us {floor / seconds:5.0%} of the copy rate"

    row: dict = {**dataclasses.asdict(panel), "weight_bytes": panel.weight_bytes(), "floor_s": floor}
    row["xla"] = time_copies(xla_call(panel), x, weights, repeats)
    print(line("XLA", row["xla"]["time_s"]), flush=True)
    row["tilings"] = []
    w_view = weights[0] if panel.kind == "swiglu" else weights[0][:, None, :]
    for tiling in tilings:
        if panel_problem(x, w_view, tiling):
            continue
        try:
            timing = time_copies(kernel_call(panel, tiling), x, weights, repeats)
        except Exception as err:  # noqa: BLE001 - record it and go on with the other tilings
            row["tilings"].append({"tiling": dataclasses.asdict(tiling), "error": str(err)[:300]})
            print(f"{panel.name:20} {tiling} failed: {str(err)[:200]}", flush=True)
            continue
        row["tilings"].append({"tiling": dataclasses.asdict(tiling), **timing})
        label = f"n{tiling.block_n} k{tiling.block_k} s{tiling.split_k} st{tiling.num_stages} w{tiling.num_warps}"
        print(line(label, timing["time_s"]), flush=True)
    ok = [t for t in row["tilings"] if "time_s" in t]
    if ok:
        row["best"] = min(ok, key=lambda t: t["time_s"])
        print(line(f"best {row['best']['tiling']}", row["best"]["time_s"]), flush=True)
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlra bench panel_products", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--panels", default="", help="comma-separated first words of panel names (default all)")
    parser.add_argument(
        "--sweep", default="", help="comma-separated row counts whose panels time every tiling, not just the default"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/panel_products.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("the panel kernels run on NVIDIA GPUs (Pallas Triton)")
    bandwidth = copy_bandwidth(2.0)
    print(f"copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    names = set(args.panels.split(",")) if args.panels else None
    results = []
    for panel in PANELS:
        if names and panel.name.split(" ")[0] not in names:
            continue
        default = default_tiling(panel.k, panel.n, 2 if panel.kind == "swiglu" else 1)
        swept = str(panel.rows) in args.sweep.split(",")
        tilings = [default, *(t for t in SWEEP if t != default)] if swept else [default]
        results.append(measure(panel, tilings, args.repeats, bandwidth))
    save(args.out, "panel_products", results, copy_bandwidth_bytes_per_s=bandwidth)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
