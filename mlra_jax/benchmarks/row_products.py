"""The batch-1 row-product kernels (pallas_kernels.row_products_gpu) on a GPU: their tilings against XLA's GEMMs.

    mlra bench row_products tune  --out=experiments/results/row_products_h100.json
    mlra bench row_products chain --out=experiments/results/row_products_chain_h100.json

`tune`: each product of a 2.9B decode layer at batch 1 (the shapes of MLRA-4 and MLA), for every tiling in
the --tilings set, against XLA's GEMM on two copies of the row, as the XLA path runs it (xla_gemm). Every
call reads its own copy of the weight, out of --copies (more bytes than the L2 holds), so no call reads a
weight from the cache; device time per call is the profiler's span of all copies over their number (median
of --repeats), with the bytes over that time.

`chain`: the MLP half of 24 layers (norm, SwiGLU, down projection, residual add) as the fused kernels and as
XLA runs it, each layer with its own weights: the profiler's span per layer, with the kernels' launches and
their dependencies as in a decode step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from mlra_jax.benchmarks.common import filled_like, profiled_time, save
from mlra_jax.benchmarks.roofline import copy_bandwidth
from mlra_jax.decode.serving import serving_compiler_options
from mlra_jax.layers import rms_norm
from mlra_jax.pallas_kernels.row_products_gpu import (
    SWIGLU_TILING,
    Tiling,
    default_tiling,
    matvec_add,
    norm_matvec,
    swiglu_norm_matvec,
)

EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Product:
    """One product of a decode layer: W [N, K] (kind "swiglu": [2, N, K]), the row's dtype, its norm."""

    name: str
    n: int
    k: int
    kind: str  # "norm" (norm_matvec), "swiglu" (swiglu_norm_matvec), "add" (matvec_add)
    row_dtype: jnp.dtype = jnp.float32

    def weight_shape(self) -> tuple[int, ...]:
        return (2, self.n, self.k) if self.kind == "swiglu" else (self.n, self.k)

    def weight_bytes(self) -> int:
        return 2 * math.prod(self.weight_shape())


PRODUCTS = (
    Product("x_proj (MLRA-4)", 1600, 3072, "norm"),
    Product("x_proj (MLA)", 2112, 3072, "norm"),
    Product("q_up (MLRA-4)", 4608, 1024, "norm", jnp.bfloat16),
    Product("q_up (MLA)", 4608, 1536, "norm", jnp.bfloat16),
    Product("o_proj", 3072, 3072, "add", jnp.bfloat16),
    Product("gate_up", 9984, 3072, "swiglu"),
    Product("down", 3072, 9984, "add", jnp.bfloat16),
)
TILING_SETS = {
    "loops": (
        *(
            Tiling("fma", rows, k, warps, prefetch=prefetch)
            for rows, k, warps, prefetch in itertools.product((2, 4, 8), (256, 512, 1024), (2, 4), (1, 2))
        ),
        *(
            Tiling("dot", rows, k, 4, stages)
            for rows, k, stages in itertools.product((16, 32, 64), (128, 256, 512), (3, 4))
        ),
    ),
    "unroll": tuple(
        Tiling("fma", rows, k, warps, unroll=True)
        for rows, k, warps in itertools.product((1, 2, 4, 8), (256, 512, 1024), (2, 4, 8))
    ),
    "dot": tuple(
        Tiling("dot", rows, k, warps, stages)
        for rows, k, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4))
    ),
}


def fused_call(product: Product, tiling: Tiling) -> Callable:
    """The kernel of `product` as f(row, weight, scale_or_residual)."""
    if product.kind == "swiglu":
        return lambda x, w, s: swiglu_norm_matvec(x, w, s, eps=EPS, tiling=tiling)
    if product.kind == "add":
        return lambda h, w, r: matvec_add(h, w, r, tiling=tiling)
    return lambda x, w, s: norm_matvec(x, w, s, eps=EPS, tiling=tiling)


def xla_gemm(product: Product) -> Callable:
    """The product alone as the XLA path runs it on GPUs: XLA's GEMM on two copies of the row (layers.two_rows),
    W as stored there ([K, N]; gate and up [K, 2, N]). The row's norm, the SwiGLU and the residual add are left
    out (timed apart, XLA would merge the copies' norms into one kernel), so the fused kernels, which do them,
    are timed against less work than they replace."""

    def run(x, w_kn, extra):
        del extra
        rows = jnp.broadcast_to(x.astype(jnp.bfloat16)[None], (2,) + x.shape)
        spec = "mk,kgn->mgn" if product.kind == "swiglu" else "mk,kn->mn"
        return jnp.einsum(spec, rows, w_kn)[0]

    return run


def xla_mlp_layer(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, scale: jax.Array) -> jax.Array:
    """x + MLP(rms_norm(x)) for one row as the XLA path runs it on GPUs (layers.MLP on two copies of the row)."""
    rows = jnp.broadcast_to(rms_norm(x, scale, EPS).astype(jnp.bfloat16)[None], (2,) + x.shape)
    both = jnp.einsum("mk,kgn->mgn", rows, w_gate_up)
    return x + jnp.einsum("mn,nk->mk", jax.nn.silu(both[:, 0]) * both[:, 1], w_down)[0].astype(x.dtype)


def inputs(product: Product, copies: int, transposed: bool) -> tuple:
    """The row, `copies` weights (stored [N, K], or as XLA's GEMM reads them) and the scale or residual."""
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (product.k,), jnp.float32).astype(product.row_dtype)
    shape = product.weight_shape()
    if transposed:
        shape = (product.k, 2, product.n) if product.kind == "swiglu" else (product.k, product.n)
    weights = filled_like([jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * copies, scale=0.02)
    extra = jax.random.normal(keys[1], (product.n if product.kind == "add" else product.k,), jnp.float32)
    return x, weights, extra


def time_copies(call: Callable, x: jax.Array, weights: list[jax.Array], extra: jax.Array, repeats: int) -> dict:
    """Device seconds per call: one jitted function calls `call` on each weight copy."""
    run = jax.jit(lambda x, ws, e: [call(x, w, e) for w in ws], compiler_options=serving_compiler_options(1))
    timing = profiled_time(lambda: run(x, weights, extra), repeats)
    per_call = {name: t / len(weights) for name, t in sorted(timing["kernels_s"].items(), key=lambda kv: -kv[1])[:4]}
    return {"time_s": timing["time_s"] / len(weights), "kernels_s": per_call}


def tune(args: argparse.Namespace) -> list[dict]:
    results = []
    names = args.products.split(",") if args.products else None
    for product in PRODUCTS:
        if names and product.name.split(" ")[0] not in names:
            continue
        x, weights, extra = inputs(product, args.copies, transposed=True)
        xla = time_copies(xla_gemm(product), x, weights, extra, args.repeats)
        del weights
        print(
            f"{product.name:16} XLA      {xla['time_s'] * 1e6:7.2f} us "
            f"{product.weight_bytes() / xla['time_s'] / 1e9:6.0f} GB/s",
            flush=True,
        )
        row = {
            "product": product.name,
            "n": product.n,
            "k": product.k,
            "kind": product.kind,
            "weight_bytes": product.weight_bytes(),
            "xla": xla,
            "tilings": [],
        }
        x, weights, extra = inputs(product, args.copies, transposed=False)
        for tiling in TILING_SETS[args.tilings]:
            if tiling.fitted(product.n, product.k) != tiling:
                continue
            try:
                timing = time_copies(fused_call(product, tiling), x, weights, extra, args.repeats)
            except Exception as err:  # noqa: BLE001 - record it and go on with the other tilings
                row["tilings"].append({"tiling": dataclasses.asdict(tiling), "error": str(err)[:300]})
                print(f"{product.name:16} {tiling} failed: {str(err)[:200]}", flush=True)
                continue
            row["tilings"].append(
                {
                    "tiling": dataclasses.asdict(tiling),
                    **timing,
                    "gb_s": product.weight_bytes() / timing["time_s"] / 1e9,
                }
            )
            print(
                f"{product.name:16} {tiling.engine} {tiling.block_rows:3}x{tiling.block_k:<5} w{tiling.num_warps} "
                f"s{tiling.num_stages} p{tiling.prefetch} u{int(tiling.unroll)} {timing['time_s'] * 1e6:7.2f} us "
                f"{product.weight_bytes() / timing['time_s'] / 1e9:6.0f} GB/s",
                flush=True,
            )
        ok = [t for t in row["tilings"] if "time_s" in t]
        if ok:
            best = min(ok, key=lambda t: t["time_s"])
            row["best"] = best
            print(
                f"{product.name:16} best {best['tiling']} {best['time_s'] * 1e6:.2f} us against XLA's "
                f"{xla['time_s'] * 1e6:.2f}",
                flush=True,
            )
        results.append(row)
        del weights
        save(args.out, "row_products_tune", results, copy_bandwidth_bytes_per_s=args.copy_bandwidth)
    return results


def chain(args: argparse.Namespace) -> list[dict]:
    """The MLP half of `layers` layers, fused and as XLA runs it, per layer."""
    d, f, layers = 3072, 9984, args.layers
    gate_up = Product("gate_up", f, d, "swiglu")
    down = Product("down", d, f, "add", jnp.bfloat16)
    key = jax.random.key(0)
    x = jax.random.normal(key, (d,), jnp.float32)
    scale = jnp.ones((d,), jnp.float32)
    results = []
    for fused in (False, True):
        _, w1, _ = inputs(gate_up, layers, transposed=not fused)
        _, w2, _ = inputs(down, layers, transposed=not fused)
        swiglu, add = fused_call(gate_up, args.gate_up_tiling), fused_call(down, args.down_tiling)

        def run(x, w1, w2):
            for a, b in zip(w1, w2):
                x = add(swiglu(x, a, scale), b, x) if fused else xla_mlp_layer(x, a, b, scale)
            return x

        step = jax.jit(run, compiler_options=serving_compiler_options(1))
        timing = profiled_time(functools.partial(step, x, w1, w2), args.repeats)
        bytes_ = layers * (gate_up.weight_bytes() + down.weight_bytes())
        label = "fused" if fused else "xla"
        results.append(
            {
                "path": label,
                "layers": layers,
                "time_per_layer_s": timing["time_s"] / layers,
                "gb_s": bytes_ / timing["time_s"] / 1e9,
                "kernels_per_layer_s": {n: t / layers for n, t in timing["kernels_s"].items()},
            }
        )
        if fused:
            results[-1]["tilings"] = {
                "gate_up": dataclasses.asdict(args.gate_up_tiling),
                "down": dataclasses.asdict(args.down_tiling),
            }
        print(
            f"MLP chain {label:6} {timing['time_s'] / layers * 1e6:7.2f} us per layer, "
            f"{bytes_ / timing['time_s'] / 1e9:6.0f} GB/s",
            flush=True,
        )
        del w1, w2
        save(args.out, "row_products_chain", results, copy_bandwidth_bytes_per_s=args.copy_bandwidth)
    return results


def parse_tiling(text: str) -> Tiling:
    """engine,block_rows,block_k,num_warps,num_stages,prefetch,unroll (a prefix of them; unroll 0 or 1)."""
    engine, *numbers = text.split(",")
    values = list(map(int, numbers))
    return Tiling(engine, *values[:6], *map(bool, values[6:7]))


def best_tilings(path: Path) -> dict[str, Tiling]:
    """product name -> the fastest tiling in a tune result; a ValueError that names the file when it is not one."""
    try:
        record = json.loads(path.read_text())
        best = {row["product"]: Tiling(**row["best"]["tiling"]) for row in record["results"] if "best" in row}
        if not best:
            raise ValueError("no product has a best tiling")
        return best
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path} is not a result of `row_products tune` ({type(err).__name__}: {err}); pass the --out of a tune run"
        ) from err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench row_products",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", choices=("tune", "chain"))
    parser.add_argument("--products", default="", help="comma-separated first words of product names (default all)")
    parser.add_argument("--copies", type=int, default=8, help="weight copies per timed call (tune)")
    parser.add_argument("--tilings", choices=sorted(TILING_SETS), default="loops", help="the tilings tune tries")
    parser.add_argument("--layers", type=int, default=24, help="layers of the chain")
    parser.add_argument(
        "--gate_up_tiling",
        type=parse_tiling,
        default=SWIGLU_TILING,
        help="engine,block_rows,block_k,num_warps,num_stages,prefetch,unroll of the chain's SwiGLU kernel",
    )
    parser.add_argument(
        "--down_tiling",
        type=parse_tiling,
        default=default_tiling(9984),
        help="the same for the chain's down projection",
    )
    parser.add_argument("--tuned", type=Path, help="a tune result: the chain takes its best tilings")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/row_products.json"))
    args = parser.parse_args(argv)
    if args.tuned:  # read before any work, so that a wrong file costs nothing
        try:
            best = best_tilings(args.tuned)
        except ValueError as err:
            parser.error(str(err))
        args.gate_up_tiling = best.get("gate_up", args.gate_up_tiling)
        args.down_tiling = best.get("down", args.down_tiling)
    if jax.default_backend() != "gpu":
        parser.error("the row-product kernels run on GPUs (the tests run them in interpret mode on CPU)")
    args.copy_bandwidth = copy_bandwidth(2.0)
    print(f"device-to-device copy: {args.copy_bandwidth / 1e12:.2f} TB/s", flush=True)
    (tune if args.mode == "tune" else chain)(args)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
