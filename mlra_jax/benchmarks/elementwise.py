"""The fused elementwise kernels of training (model.fused_elementwise, model.fp8_casts) against XLA's fusions, on
one GPU.

    mlra bench elementwise --experiments=gqa_2p9b,mlra4_2p9b --tokens=24576 \\
        --out=experiments/results/elementwise_h100.json

For each experiment's widths (d, f) at --tokens rows (24,576: the 8-layer proxies' batch 12 x 2048), each pass
as the training step runs it, timed apart: the residual add with the RMSNorm after it (a float32 stream, a bf16
branch and bf16 normed rows), forward and backward, and the SwiGLU product (bf16), forward (the model leaves it to
XLA) and backward, and the FP8 quantization of an operand in both layouts with its amax (a [rows, d] activation in
e4m3, a [rows, f] gradient in e5m2), on XLA (jnp, as the model computes it: the backward from jax.vjp's saved
residuals) and on the kernel for each tiling of the sweep. Each pass's time is the profiler's device span (median
of --repeats), with its bytes at the floor (every operand read once, every result written once) over that time and
the time over the floor at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mlra_jax.benchmarks.common import profiled_time, save
from mlra_jax.benchmarks.roofline import copy_bandwidth
from mlra_jax.layers import rms_norm
from mlra_jax.pallas_kernels import add_rms_norm_gpu as norms
from mlra_jax.pallas_kernels import fp8_cast_gpu, swiglu_gpu

BF16, F32 = jnp.bfloat16, jnp.float32
EPS = 1e-6
NORM_TILINGS = tuple(norms.Tiling(rows, warps) for rows, warps in itertools.product((1, 2, 4), (4, 8)))
SWIGLU_TILINGS = tuple(
    swiglu_gpu.Tiling(block, warps) for block, warps in itertools.product((1024, 2048, 4096), (4, 8))
)
CAST_TILINGS = (
    fp8_cast_gpu.DEFAULT_TILING,
    *(fp8_cast_gpu.Tiling(*rows_cols_warps) for rows_cols_warps in ((32, 128, 4), (128, 128, 8), (64, 256, 8))),
)
# Bytes per row at the floor: the norm's forward reads x (f32) and the branch (bf16) and writes the stream (f32) and
# the normed row (bf16); its backward reads the normed row's cotangent (bf16), the stream and its cotangent (f32)
# and writes the stream's (f32) and the branch's (bf16). The SwiGLU's forward reads gate and up and writes the
# product, its backward reads gate, up and the product's cotangent and writes two (bf16). An FP8 cast reads the bf16
# operand and writes it twice in one byte.
FLOOR_BYTES_PER_ELEMENT = {
    "norm_fwd": 12,
    "norm_bwd": 16,
    "swiglu_fwd": 6,
    "swiglu_bwd": 10,
    "fp8_cast_d": 4,
    "fp8_cast_f": 4,
}


@dataclasses.dataclass(frozen=True)
class Pass:
    """One timed pass: fn(*args) on XLA ("xla") or on the kernel with `tiling`; `elements` per row (d or f)."""

    name: str
    path: str
    fn: Callable[..., Any]
    args: tuple
    elements: int
    tiling: Any = None

    def floor_bytes(self, rows: int) -> int:
        return FLOOR_BYTES_PER_ELEMENT[self.name] * self.elements * rows


def xla_add_norm(x: jax.Array, branch: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The model's residual add and norm on XLA, the normed rows rounded to bf16 as the products read them."""
    stream = x + branch
    return stream, rms_norm(stream, scale, EPS).astype(BF16)


def _backward_of(fn: Callable[..., Any], args: tuple, cotangents: Any) -> tuple[Callable[..., Any], tuple]:
    """The backward of fn at args as a function of (its saved residuals, the cotangents), with its arguments."""
    _, vjp = jax.vjp(fn, *args)
    return (lambda vjp, cotangents: vjp(cotangents)), (vjp, cotangents)


def passes(rows: int, d: int, f: int, interpret: bool = False) -> list[Pass]:
    """Every pass of the sweep at `rows` rows of width d (norms) and f (SwiGLU), on random inputs."""
    keys = jax.random.split(jax.random.key(0), 7)
    x = 3 * jax.random.normal(keys[0], (rows, d), F32)
    branch = jax.random.normal(keys[1], (rows, d), BF16)
    scale = 1 + 0.1 * jax.random.normal(keys[2], (d,), F32)
    d_stream, d_normed = jax.random.normal(keys[3], (rows, d), F32), jax.random.normal(keys[4], (rows, d), BF16)
    gate, up = (jax.random.normal(k, (rows, f), BF16) for k in keys[5:7])
    d_out = jax.random.normal(keys[0], (rows, f), BF16)
    norm_args = (x, branch, scale)
    result = [
        Pass("norm_fwd", "xla", xla_add_norm, norm_args, d),
        Pass("norm_bwd", "xla", *_backward_of(xla_add_norm, norm_args, (d_stream, d_normed)), d),
        Pass("swiglu_fwd", "xla", swiglu_gpu.swiglu_reference, (gate, up), f),
        Pass("swiglu_bwd", "xla", *_backward_of(swiglu_gpu.swiglu_reference, (gate, up), d_out), f),
    ]
    for tiling in NORM_TILINGS:
        kernel = lambda x, b, s, tiling=tiling: norms.add_rms_norm(
            x, b, s, eps=EPS, out_dtype=BF16, tiling=tiling, interpret=interpret
        )
        result.append(Pass("norm_fwd", "kernel", kernel, norm_args, d, tiling))
        result.append(Pass("norm_bwd", "kernel", *_backward_of(kernel, norm_args, (d_stream, d_normed)), d, tiling))
    for tiling in SWIGLU_TILINGS:
        kernel = lambda g, u, tiling=tiling: swiglu_gpu.swiglu(g, u, tiling=tiling, interpret=interpret)
        forward = lambda g, u, tiling=tiling: swiglu_gpu.swiglu_forward(g, u, tiling=tiling, interpret=interpret)
        result.append(Pass("swiglu_fwd", "kernel", forward, (gate, up), f, tiling))
        result.append(Pass("swiglu_bwd", "kernel", *_backward_of(kernel, (gate, up), d_out), f, tiling))
    inverse_scale = jnp.float32(64.0)  # |x| up to 7 in e4m3, 895 in e5m2
    casts = (("fp8_cast_d", branch, jnp.float8_e4m3fn, d), ("fp8_cast_f", d_out, jnp.float8_e5m2, f))
    for name, operand, dtype, width in casts:
        reference = lambda x, s, dtype=dtype: fp8_cast_gpu.quantize_both_reference(x, s, dtype)
        result.append(Pass(name, "xla", reference, (operand, inverse_scale), width))
        for tiling in CAST_TILINGS:
            kernel = lambda x, s, dtype=dtype, tiling=tiling: fp8_cast_gpu.quantize_both(
                x, s, dtype, tiling=tiling, interpret=interpret
            )
            result.append(Pass(name, "kernel", kernel, (operand, inverse_scale), width, tiling))
    return result


def time_pass(item: Pass, rows: int, repeats: int, bandwidth: float) -> dict[str, Any]:
    run = jax.jit(item.fn)
    timing = profiled_time(lambda: run(*item.args), repeats)
    floor = item.floor_bytes(rows)
    return {
        "pass": item.name,
        "path": item.path,
        "tiling": None if item.tiling is None else dataclasses.asdict(item.tiling),
        "time_s": timing["time_s"],
        "kernels_s": timing["kernels_s"],
        "floor_bytes": floor,
        "gb_s_at_floor": floor / timing["time_s"] / 1e9,
        "over_floor": timing["time_s"] * bandwidth / floor,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench elementwise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiments", default="gqa_2p9b,mlra4_2p9b", help="whose widths d and f to time")
    parser.add_argument("--tokens", type=int, default=12 * 2048, help="rows of each pass")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/elementwise.json"))
    args = parser.parse_args(argv)
    from mlra_jax.benchmarks.common import experiment_list
    from mlra_jax.experiments import get_experiment

    names = experiment_list(parser, args.experiments)
    if jax.default_backend() != "gpu":
        parser.error("the elementwise kernels run on NVIDIA GPUs (the tests run them in interpret mode on CPU)")
    bandwidth = copy_bandwidth(2.0)
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = []
    for name in names:
        model = get_experiment(name).model
        best: dict[tuple[str, str], dict[str, Any]] = {}
        for item in passes(args.tokens, model.n_embd, model.intermediate_size):
            try:
                row = time_pass(item, args.tokens, args.repeats, bandwidth)
            except Exception as err:  # noqa: BLE001 - record it and go on with the other tilings
                row = {"pass": item.name, "path": item.path, "tiling": dataclasses.asdict(item.tiling)}
                row["error"] = str(err)[:300]
                print(f"{name} {item.name} {item.path} {item.tiling} failed: {str(err)[:200]}", flush=True)
            else:
                print(
                    f"{name:12} {item.name:10} {item.path:6} {str(row['tiling'] or ''):44} "
                    f"{row['time_s'] * 1e6:8.1f} us {row['gb_s_at_floor']:6.0f} GB/s {row['over_floor']:.2f}x floor",
                    flush=True,
                )
                key = (item.name, item.path)
                if key not in best or row["time_s"] < best[key]["time_s"]:
                    best[key] = row
            results.append(
                {"experiment": name, "rows": args.tokens, "d": model.n_embd, "f": model.intermediate_size, **row}
            )
        for (pass_name, path), row in sorted(best.items()):
            print(f"{name:12} best {pass_name:10} {path:6} {row['time_s'] * 1e6:8.1f} us {row['tiling'] or ''}")
        save(args.out, "elementwise", results, copy_bandwidth_bytes_per_s=bandwidth)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
