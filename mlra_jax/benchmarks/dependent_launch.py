"""Whether programmatic dependent launch (PDL) overlaps consecutive kernels of a jitted step on this GPU and jax.

    mlra bench dependent_launch --out=experiments/results/dependent_launch_h200.json

A chain of --layers kernels in one jit, as a decode step chains its layers' kernels: kernel i reads a weight W_i of
its own (written by no kernel of the step) and x, the output of kernel i - 1, and writes y_i = sum of W_i's tiles + x.
Each kernel reads 8.65 MB (Mosaic GPU: 132 CTAs of eight 8 KiB tiles) or 8.4 MB (Pallas Triton: 256 programs of
8 rows of 2048). The variants place PTX's `griddepcontrol` instructions:

* plain:    none (an ordinary launch);
* wait0:    griddepcontrol.wait first (jax then launches a Mosaic GPU kernel with PDL: it may be scheduled while
            the kernel before it drains, and waits there);
* prefetch: W_i's loads issued, then the wait, then x's load (Mosaic GPU only);
* trigger:  prefetch, after griddepcontrol.launch_dependents first (the next kernel may be scheduled at once).

Pallas Triton kernels take the instructions as inline assembly; whether XLA launches them with PDL shows in the
time. Kind `mixed` alternates a Pallas Triton kernel with a Mosaic GPU kernel, both of the Mosaic chain's work
(W_i's 8 tiles per program added to x), as a decode step would if its Triton row kernels were followed by Mosaic
GPU ones: the Triton kernel `plain` or `trigger` (launch_dependents as inline assembly, before x's load), the Mosaic
GPU kernel one of the variants above. Whether an early trigger from a kernel that is not itself launched with PDL
lets the next one load its weights early shows as the pair's time.

Each row: the chain's wall time per kernel (the best of 5 runs of 50 calls), the kernel's bytes and their floor at
the copy bandwidth measured in the same process. Where PDL is not in effect, the wait returns at once and
every variant times like `plain`. --no_command_buffers runs the chain outside XLA's command buffers (CUDA graphs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from mlra_jax.benchmarks.common import save
from mlra_jax.benchmarks.roofline import copy_bandwidth
from mlra_jax.pallas_kernels.gpu_interpret import interpret_params

VARIANTS = ("plain", "wait0", "prefetch", "trigger")
TRITON_VARIANTS = ("plain", "wait0")
MIXED_VARIANTS = (("plain", "plain"), ("plain", "prefetch"), ("trigger", "prefetch"), ("trigger", "trigger"))
KIND_VARIANTS = {"mosaic": VARIANTS, "triton": TRITON_VARIANTS, "mixed": MIXED_VARIANTS}  # --kinds: their variants
CTAS, ROWS, COLS, TILES = 132, 64, 64, 8  # Mosaic GPU: CTAs, one SMEM tile (128-byte rows), W tiles per CTA
TRITON_ROWS, TRITON_K = 8, 2048  # Pallas Triton: rows of W per program, row length (and x's length)


def mosaic_layer(variant: str, ctas: int = CTAS, interpret: bool = False) -> Callable:
    """One Mosaic GPU kernel of the chain: (W [ctas, TILES, ROWS, COLS], x [ctas, ROWS, COLS]) -> y like x;
    interpret=True runs it in GPU interpret mode (on CPU, for the tests)."""
    transforms = (plgpu.TilingTransform((8, COLS)), plgpu.SwizzleTransform(128))

    def body(w_ref, x_ref, y_ref, w_smem, x_smem, w_barrier, x_barrier):
        cta = lax.axis_index("cta")
        if variant == "trigger":
            plgpu.griddepcontrol_launch_dependents()
        if variant == "wait0":
            plgpu.griddepcontrol_wait()
        for t in range(TILES):
            plgpu.copy_gmem_to_smem(w_ref.at[cta, t], w_smem.at[t], w_barrier.at[0])
        if variant in ("prefetch", "trigger"):
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_ref.at[cta], x_smem, x_barrier.at[0])
        plgpu.barrier_wait(w_barrier.at[0])
        plgpu.barrier_wait(x_barrier.at[0])
        acc = x_smem[...].astype(jnp.float32)
        for t in range(TILES):
            acc = acc + w_smem.at[t][...].astype(jnp.float32)
        x_smem[...] = acc.astype(x_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, y_ref.at[cta])
        plgpu.wait_smem_to_gmem(0)

    def entry(w_ref, x_ref, y_ref):
        pl.run_scoped(
            lambda *scoped: body(w_ref, x_ref, y_ref, *scoped),
            plgpu.SMEM((TILES, ROWS, COLS), jnp.bfloat16, transforms=transforms),
            plgpu.SMEM((ROWS, COLS), jnp.bfloat16, transforms=transforms),
            plgpu.Barrier(num_arrivals=TILES, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((ctas, ROWS, COLS), jnp.bfloat16),
        grid=(ctas,),
        grid_names=("cta",),
        interpret=interpret_params(interpret),
    )


def _asm_zero(instruction: str) -> jax.Array:
    """0 from inline assembly that runs `instruction` first: an index offset that orders the instruction before
    the load that takes it."""
    zeros = jnp.zeros((16,), jnp.int32)
    offset = pltriton.elementwise_inline_asm(
        f"{instruction}; mov.u32 $0, $1;",
        args=[zeros],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(zeros.shape, zeros.dtype)],
    )[0]
    return jnp.max(offset)


def triton_layer(variant: str) -> Callable:
    """One Pallas Triton kernel of the chain: (W [TRITON_K, TRITON_K], x [TRITON_K]) -> y = W x, like x."""

    def kernel(w_ref, x_ref, y_ref):
        start = _asm_zero("griddepcontrol.wait") if variant == "wait0" else 0  # x's load follows the wait
        w = w_ref[...].astype(jnp.float32)
        x = x_ref[pl.ds(start, TRITON_K)].astype(jnp.float32)
        y_ref[...] = jnp.sum(w * x[None, :], axis=1).astype(y_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((TRITON_K,), jnp.bfloat16),
        grid=(TRITON_K // TRITON_ROWS,),
        in_specs=[pl.BlockSpec((TRITON_ROWS, TRITON_K), lambda i: (i, 0)), pl.BlockSpec((TRITON_K,), lambda i: (0,))],
        out_specs=pl.BlockSpec((TRITON_ROWS,), lambda i: (i,)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    )


def triton_tile_layer(variant: str, ctas: int = CTAS, interpret: bool = False) -> Callable:
    """The Mosaic chain's kernel as a Pallas Triton kernel (program i adds W[i]'s tiles to x[i]): `plain`, or
    `trigger` (griddepcontrol.launch_dependents before x's load)."""

    def kernel(w_ref, x_ref, y_ref):
        start = _asm_zero("griddepcontrol.launch_dependents") if variant == "trigger" else 0
        acc = x_ref[pl.ds(start, ROWS), :].astype(jnp.float32)
        for t in range(TILES):
            acc = acc + w_ref[t].astype(jnp.float32)
        y_ref[...] = acc.astype(y_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((ctas, ROWS, COLS), jnp.bfloat16),
        grid=(ctas,),
        in_specs=[
            pl.BlockSpec((None, TILES, ROWS, COLS), lambda i: (i, 0, 0, 0)),
            pl.BlockSpec((None, ROWS, COLS), lambda i: (i, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, ROWS, COLS), lambda i: (i, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
    )


def alternating(first: Callable, second: Callable) -> Callable:
    """A layer of the mixed chain: `first` on W[0] of the pair, then `second` on W[1]."""
    return lambda w, x: second(w[1], first(w[0], x))


def chain(layer: Callable) -> Callable:
    """The layers' kernels in one jit, unrolled: x -> layer(W_0, x) -> layer(W_1, ...) ..."""

    @jax.jit
    def run(weights: jax.Array, x: jax.Array) -> jax.Array:
        def step(x, w):
            return layer(w, x), None

        return lax.scan(step, x, weights, unroll=True)[0]

    return run


def chain_inputs(kind: str, layers: int) -> tuple[jax.Array, jax.Array]:
    if kind == "mixed":
        shape, x = (layers // 2, 2, CTAS, TILES, ROWS, COLS), jnp.ones((CTAS, ROWS, COLS), jnp.bfloat16)
    elif kind == "mosaic":
        shape, x = (layers, CTAS, TILES, ROWS, COLS), jnp.ones((CTAS, ROWS, COLS), jnp.bfloat16)
    else:
        shape, x = (layers, TRITON_K, TRITON_K), jnp.ones((TRITON_K,), jnp.bfloat16)
    return jax.random.normal(jax.random.key(0), shape, jnp.bfloat16) * 0.01, x


def best_time(fn: Callable, *args, calls: int = 50, runs: int = 5) -> float:
    """Seconds per call: the best of `runs` runs of `calls` calls dispatched back to back."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mlra bench dependent_launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kinds", default="mosaic,triton,mixed", help="mosaic (Mosaic GPU), triton (Pallas Triton), mixed (the two)"
    )
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--no_command_buffers", action="store_true", help="XLA_FLAGS=--xla_gpu_enable_command_buffer=")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/dependent_launch.json"))
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KIND_VARIANTS):
        parser.error(f"unknown kind {sorted(unknown)[0]!r}; kinds: {', '.join(KIND_VARIANTS)}")
    if args.layers < 2 or ("mixed" in kinds and args.layers % 2):
        parser.error(f"--layers={args.layers}: a chain takes at least 2 kernels (an even count with kind mixed)")
    if args.no_command_buffers:  # read when the backend starts, so before the first use of jax
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    if jax.default_backend() != "gpu":
        parser.error(f"this benchmark times GPU kernels; the backend is {jax.default_backend()!r}")
    bandwidth = copy_bandwidth(2.0)
    results = []
    for kind in kinds:
        weights, x = chain_inputs(kind, args.layers)
        per_kernel = weights[0].size // (2 if kind == "mixed" else 1)
        layer_bytes = per_kernel * weights.dtype.itemsize + 2 * x.size * x.dtype.itemsize
        for variant in KIND_VARIANTS[kind]:
            if kind == "mixed":
                layer = alternating(triton_tile_layer(variant[0]), mosaic_layer(variant[1]))
                variant = "+".join(variant)
            else:
                layer = mosaic_layer(variant) if kind == "mosaic" else triton_layer(variant)
            seconds = best_time(chain(layer), weights, x) / args.layers
            row = {
                "kind": kind,
                "variant": variant,
                "command_buffers": not args.no_command_buffers,
                "us_per_kernel": seconds * 1e6,
                "bytes_per_kernel": layer_bytes,
                "floor_us": layer_bytes / bandwidth * 1e6,
                "copy_bandwidth_bytes_per_s": bandwidth,
            }
            row["over_floor"] = row["us_per_kernel"] / row["floor_us"]
            results.append(row)
            print(f"{kind:6s} {variant:8s} {row['us_per_kernel']:6.2f} us per kernel ({row['over_floor']:.2f}x floor)")
    print(f"saved {args.out}", file=sys.stderr)
    save(args.out, "dependent_launch", results)


if __name__ == "__main__":
    main()
