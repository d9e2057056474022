"""The training attention core on an NVIDIA GPU: cuDNN (the trainer's kernel) against the Pallas kernels JAX ships.

    mlra bench attention_kernels --out=experiments/results/attention_kernels_h100.json

For each experiment's attention layer (its heads and key / value widths, sequences of its length):

* cuDNN's flash attention, causal, forward and forward + backward, bf16: what `attention_impl=auto` runs;
* JAX's Pallas Triton flash attention (`jax.experimental.pallas.ops.gpu.attention`), causal, forward + backward,
  bf16, at a few tilings; it takes one head width, so the value is zero-padded to the key's;
* JAX's Mosaic GPU attention (`...ops.gpu.attention_mgpu`, FlashAttention-3's design), float16 only: causal
  forward, and forward + backward without a mask (it has no causal backward), beside cuDNN's on the same call.

Keys and values have as many heads as the queries. Each time is the profiler's GPU span of one call, median of
`--repeats`; the rate counts model FLOPs (2 (d_qk + d_v) per head per visible key forward, 3x that forward +
backward, as MFU does). A kernel that cannot take a call is recorded with its error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mlra_jax.attention import attention_class
from mlra_jax.attention.fused import cudnn_attention
from mlra_jax.benchmarks.common import experiment_list, profiled_time, save
from mlra_jax.experiments import get_experiment

TRITON_TILINGS = ((128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3))  # block_q, block_k, warps, stages
MOSAIC_TILINGS = ((64, 128, 2), (64, 64, 2))  # block_q, block_kv, concurrent steps


def model_flops(batch: int, heads: int, length: int, dk: int, dv: int, causal: bool, backward: bool) -> float:
    """Model FLOPs of one attention call: 2 (dk + dv) per head per visible key, 3x that with the backward."""
    visible = length * (length + 1) / 2 if causal else length * length
    return batch * heads * visible * 2 * (dk + dv) * (3 if backward else 1)


def with_backward(attend: Callable[..., jax.Array]) -> Callable[..., Any]:
    """The gradients of sum(attend(q, k, v) * do) with respect to q, k and v: one forward and one backward."""

    def loss(q, k, v, do):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def layer_inputs(
    batch: int, heads: int, length: int, dk: int, dv: int, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Random q, k [B, T, H, dk], v [B, T, H, dv] and the output's cotangent do [B, T, H, dv]."""
    keys = jax.random.split(jax.random.key(0), 4)
    widths = (dk, dk, dv, dv)
    return tuple(jax.random.normal(key, (batch, length, heads, w), dtype) for key, w in zip(keys, widths))


def padded(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - x.shape[-1])))


def measure(fn: Callable[..., Any], args: tuple, flops: float, repeats: int, **row: Any) -> dict[str, Any]:
    """One row: the GPU time of fn(*args) and its rate, or the error that stopped it."""
    try:
        seconds = profiled_time(lambda: fn(*args), repeats)["time_s"]
    except Exception as error:  # a kernel that cannot take this call: recorded, the others still run
        return {**row, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    return {**row, "time_s": seconds, "model_tflops_per_s": flops / seconds / 1e12}


def case_rows(name: str, batch: int, repeats: int) -> list[dict[str, Any]]:
    """Every kernel's rows for one experiment's attention layer."""
    experiment = get_experiment(name)
    heads, dk, dv = attention_class(experiment.model.variant).core_shape(experiment.model)
    length, scale = experiment.train.seq_len, dk**-0.5
    shape = {"experiment": name, "batch": batch, "heads": heads, "seq_len": length, "dk": dk, "dv": dv}

    def row(kernel: str, fn: Callable[..., Any], args: tuple, causal: bool, **labels: Any) -> dict[str, Any]:
        backward = len(args) == 4  # with the output's cotangent
        flops = model_flops(batch, heads, length, dk, dv, causal, backward)
        passes = "forward+backward" if backward else "forward"
        mask = "causal" if causal else "none"
        return measure(fn, args, flops, repeats, kernel=kernel, mask=mask, passes=passes, **labels, **shape)

    q, k, v, do = layer_inputs(batch, heads, length, dk, dv, jnp.bfloat16)
    cudnn = lambda q, k, v: cudnn_attention(q, k, v, scale=scale)  # noqa: E731
    rows = [
        row("cudnn", jax.jit(cudnn), (q, k, v), True, dtype="bfloat16"),
        row("cudnn", with_backward(cudnn), (q, k, v, do), True, dtype="bfloat16"),
    ]
    from jax.experimental.pallas.ops.gpu import attention as triton_attention

    wide = (q, k, padded(v, dk), padded(do, dk))  # Triton's kernel takes one head width
    for block_q, block_k, warps, stages in TRITON_TILINGS:
        tiles = dict(block_q=block_q, block_k=block_k, block_q_dkv=block_q, block_kv_dkv=block_k)
        blocks = triton_attention.BlockSizes(**tiles, block_q_dq=block_q, block_kv_dq=block_k)
        triton = lambda q, k, v, b=blocks, w=warps, s=stages: triton_attention.mha(  # noqa: E731
            q, k, v, None, scale, True, b, "triton", w, s
        )
        tiling = {"block_q": block_q, "block_k": block_k, "warps": warps, "stages": stages}
        rows.append(row("pallas_triton", with_backward(triton), wide, True, dtype="bfloat16", tiling=tiling))
    return rows + mosaic_rows(row, [x.astype(jnp.float16) for x in wide], padded_from=dv if dv < dk else None)


def mosaic_rows(row: Callable[..., dict[str, Any]], inputs: list[jax.Array], padded_from: int | None) -> list[dict]:
    """Mosaic GPU's causal forward, and its forward + backward without a mask beside cuDNN's: float16, the value
    padded to the key's width, no scale (the kernel takes one width, float16 only and no scale)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mosaic

    labels = {"dtype": "float16"} | ({"value_padded_from": padded_from} if padded_from else {})
    q, k, v, do = inputs
    unmasked = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=1.0, implementation="cudnn")  # noqa: E731
    rows = [row("cudnn", with_backward(unmasked), (q, k, v, do), False, **labels)]
    for block_q, block_kv, steps in MOSAIC_TILINGS:
        tiling = {"block_q": block_q, "block_kv": block_kv, "max_concurrent_steps": steps}
        causal = mosaic.TuningConfig(**tiling, causal=True)
        attend = lambda q, k, v, c=causal: mosaic.attention(q, k, v, c)  # noqa: E731
        rows.append(row("mosaic_gpu", jax.jit(attend), (q, k, v), True, tiling=tiling, **labels))
        backward_tiles = dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
        both = mosaic.TuningConfig(**tiling, compute_wgs_bwd=2, **backward_tiles)
        attend = lambda q, k, v, c=both: mosaic.attention(q, k, v, c)  # noqa: E731
        tiling = {**tiling, "compute_wgs_bwd": 2, **backward_tiles}
        rows.append(row("mosaic_gpu", with_backward(attend), (q, k, v, do), False, tiling=tiling, **labels))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench attention_kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--experiments", default="gqa_2p9b,mlra4_2p9b", help="comma-separated experiment names")
    parser.add_argument("--batch", type=int, default=8, help="sequences per call")
    parser.add_argument("--repeats", type=int, default=10, help="profiled calls per row (the median is kept)")
    parser.add_argument(
        "--out", type=Path, default=Path("experiments/results/attention_kernels.json"), help="the JSON record"
    )
    args = parser.parse_args(argv)
    names = experiment_list(parser, args.experiments)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be at least 1")
    if jax.default_backend() != "gpu":
        parser.error(
            f"cuDNN and the Pallas GPU kernels need an NVIDIA GPU; this machine's backend is {jax.default_backend()!r}"
        )
    results = []
    for name in names:
        for row in case_rows(name, args.batch, args.repeats):
            results.append(row)
            rate = f"{row['model_tflops_per_s']:6.1f} TFLOP/s" if "time_s" in row else row["error"][:90]
            print(
                f"{name:11} {row['kernel']:13} {row['mask']:6} {row['passes']:16} {row.get('tiling', '')!s:60} {rate}",
                flush=True,
            )
            save(args.out, "attention_kernels", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
