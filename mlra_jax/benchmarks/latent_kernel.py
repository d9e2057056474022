"""The Mosaic GPU latent decode kernel on a GPU: a self-check against the reference, its tuning, its bound.

    mlra bench latent_kernel          # max |error| against the jnp reference
    mlra bench latent_kernel tune     # device time per call and each kernel's share
    mlra bench latent_kernel bound --out=experiments/results/latent_kernel_bound_h100.json
    mlra bench latent_kernel heads --out=experiments/results/latent_kernel_heads_h200.json
    mlra bench latent_kernel merge --out=experiments/results/latent_kernel_merge_h200.json

`bound`: what limits a 2.9B model's batch-1 decode attention (24 heads, 8K tokens; MLA one 512-wide latent,
MLRA-4 four 128-wide blocks): the kernel and its merge over split-KV counts, and one program (splits=1) over
1 to 64 KV tiles, whose slope is the time per tile of one SM (device time: the profiler's span of 8 chained
calls over 8, median of 10).

`heads`: one device's share of the attention scope at DeepSeek-V3's 128 heads over contexts, against its floor (the
cache's bytes at the measured copy bandwidth, or its FLOPs at the measured bf16 rate): MLRA-4 at TP=4 (one latent
block of 128 with a RoPE key of 64) at the paper's per-device load and twice it, with 64 and 128 heads per CTA; MLA
at DP=4 (512 wide) at the same loads.

`merge`: the split-KV merge kernel alone with 1 to 8 heads a CTA, against the bytes it moves.
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from mlra_jax.benchmarks import roofline
from mlra_jax.benchmarks.common import device_time, profiled_time, save
from mlra_jax.experiments import get_experiment
from mlra_jax.pallas_kernels.latent_decode_common import combine
from mlra_jax.pallas_kernels.latent_decode_gpu import (
    combine_gpu,
    combine_heads,
    latent_decode_gpu,
    latent_partials_gpu,
    sm_count,
)
from mlra_jax.pallas_kernels.latent_decode_reference import reference


def decode_inputs(batch: int, heads: int, dr: int, r: int, slots: int) -> tuple[jax.Array, ...]:
    """Random bf16 arguments of the kernel for one latent block (q_rope, q_latent, k_rope, latent), every sequence's
    range the whole cache (starts, ends)."""
    keys = jax.random.split(jax.random.key(0), 4)
    return (
        jax.random.normal(keys[0], (batch, 1, heads, dr), jnp.bfloat16),
        jax.random.normal(keys[1], (batch, 1, heads, r), jnp.bfloat16),
        jax.random.normal(keys[2], (batch, slots, dr), jnp.bfloat16),
        jax.random.normal(keys[3], (batch, slots, 1, r), jnp.bfloat16),
        jnp.zeros((batch,), jnp.int32),
        jnp.full((batch,), slots, jnp.int32),
    )


def tune() -> None:
    """Device time per call and each kernel's share: the tile sizes, the split-KV merge as one kernel or XLA's,
    a contiguous or a paged cache."""

    def xla_combine(*args, **options):
        out, lse = latent_partials_gpu(*args, **options)
        return combine(out, lse, args[3].dtype)[:, :, : args[0].shape[2]]

    for heads, dr, r, batch, slots in (
        (64, 64, 128, 1, 1 << 17),
        (64, 64, 128, 1, 1 << 21),
        (64, 64, 128, 128, 1024),
        (32, 64, 256, 1, 1 << 17),
        (64, 64, 512, 1, 1 << 17),
    ):
        args = decode_inputs(batch, heads, dr, r, slots)
        pages = batch * slots // 64
        table = jax.random.permutation(jax.random.key(0), pages).astype(jnp.int32).reshape(batch, -1)
        paged = (*args[:2], args[2].reshape(pages, 64, dr), args[3].reshape(pages, 64, 1, r), *args[4:])
        moved = batch * slots * (dr + r) * 2
        for label, fn, inputs in (
            ("merge kernel", latent_decode_gpu, args),
            ("xla merge", xla_combine, args),
            ("paged", functools.partial(latent_decode_gpu, page_table=table), paged),
            ("block_kv=64", functools.partial(latent_decode_gpu, block_kv=64), args),
        ):
            if r > 256 and label == "block_kv=64":
                continue
            try:
                timing = device_time(functools.partial(fn, scale=0.07), inputs, 10, feed=1)
            except Exception as err:  # noqa: BLE001 - report and go on
                print(f"H={heads} R={r} B={batch} S={slots} {label}: failed {str(err)[:300]}", flush=True)
                continue
            kernels = ", ".join(f"{name[:24]} {t * 1e6:.1f}" for name, t in timing["kernels_s"].items())
            print(
                f"H={heads} R={r} B={batch} S={slots} {label}: {timing['time_s'] * 1e6:.1f} us, "
                f"{moved / timing['time_s'] / 1e9:.0f} GB/s ({kernels})",
                flush=True,
            )


def check() -> None:
    """The kernel against the jnp reference on the paper's shapes and odd head counts (max |error|)."""
    for heads, dr, r, n, s in (
        (64, 64, 128, 1, 5000),
        (32, 64, 256, 1, 3000),
        (64, 64, 512, 1, 4000),
        (8, 64, 128, 1, 1000),
        (96, 64, 128, 1, 1000),
        (12, 64, 256, 1, 1000),
        (64, 64, 128, 2, 704),
    ):
        keys = jax.random.split(jax.random.key(0), 4)
        bf16 = jnp.bfloat16
        args = (
            jax.random.normal(keys[0], (3, n, heads, dr), bf16),
            jax.random.normal(keys[1], (3, n, heads, r), bf16),
            jax.random.normal(keys[2], (3, s, dr), bf16),
            jax.random.normal(keys[3], (3, s, n, r), bf16),
            jnp.array([0, 17, s // 2]),
            jnp.array([s, s // 3, s // 2 + 1]),
        )
        scale = 1 / math.sqrt(dr + r)
        got = latent_decode_gpu(*args, scale=scale).astype(jnp.float32)
        want = reference(*args, scale=scale).astype(jnp.float32)
        print(
            f"H={heads} Dr={dr} R={r} N={n} S={s}: max |err| {float(jnp.abs(got - want).max()):.4f}, "
            f"max |ref| {float(jnp.abs(want).max()):.3f}",
            flush=True,
        )


BOUND_MODELS = {"mla": "mla_2p9b", "mlra4": "mlra4_2p9b"}


def bound(out: Path) -> None:
    """The batch-1 attention of the 2.9B models over split-KV counts and, in one program, over KV tiles."""
    results = []
    for name, experiment in BOUND_MODELS.items():
        cfg = get_experiment(experiment).model
        blocks, branches = cfg.latent_layout
        heads, rank, rope = cfg.n_head * branches // blocks, cfg.kv_lora_rank // blocks, cfg.qk_rope_head_dim
        keys = jax.random.split(jax.random.key(0), 4)
        slots = 8192 + 64
        base = (
            jax.random.normal(keys[0], (1, blocks, heads, rope), jnp.bfloat16),
            jax.random.normal(keys[1], (1, blocks, heads, rank), jnp.bfloat16),
            jax.random.normal(keys[2], (1, slots, rope), jnp.bfloat16),
            jax.random.normal(keys[3], (1, slots, blocks, rank), jnp.bfloat16),
            jnp.zeros((1,), jnp.int32),
        )
        settings = [(8192, splits) for splits in (None, 16, 32, 64, 128)]
        settings += [(tokens, 1) for tokens in (0, 64, 128, 1024, 4096)]
        for tokens, splits in settings:
            args = (*base, jnp.full((1,), tokens, jnp.int32))
            timing = device_time(functools.partial(latent_decode_gpu, scale=0.07, splits=splits), args, 10, feed=1)
            row = {
                "model": name,
                "tokens": tokens,
                "splits": splits,
                "time_s": timing["time_s"],
                "kernels_s": timing["kernels_s"],
                "method": timing["method"],
            }
            results.append(row)
            kernels = ", ".join(f"{k[:24]} {t * 1e6:.2f}" for k, t in timing["kernels_s"].items())
            print(
                f"{name:6} tokens={tokens:<5} splits={splits!s:<5} {timing['time_s'] * 1e6:7.2f} us ({kernels})",
                flush=True,
            )
            save(out, "latent_kernel_bound", results)


# DeepSeek-V3's 128 heads over one latent block per device: (name, latent width, batches, (heads per CTA, KV tile
# rows) settings; None is the kernel's own choice). MLRA-4 at TP=4 (a 128-wide block) at the paper's per-device load
# and twice it; MLA at DP=4 (512 wide; only 64 heads a CTA) at the same loads over four devices.
WIDE_SHAPES = (
    ("mlra4_tp4", 128, (64, 128), ((64, None), (128, 128), (128, 64))),
    ("mla_dp4", 512, (16, 32), ((None, None),)),
)


def heads(out: Path, contexts: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)) -> None:
    """One device's share of DeepSeek-V3's attention (128 heads, RoPE key of 64) per WIDE_SHAPES row, with its
    floor: the cache's bytes at the measured copy bandwidth, or its FLOPs at the measured bf16 rate."""
    heads_n, rope = 128, 64
    ceilings = roofline.measured_ceilings()
    results = []
    for name, rank, batches, settings in WIDE_SHAPES:
        for batch in batches:
            for context in contexts:
                args = decode_inputs(batch, heads_n, rope, rank, context)
                cache_bytes = batch * context * (rope + rank) * 2
                flops = batch * heads_n * context * (2 * (rope + rank) + 2 * rank)
                want = reference(*args, scale=0.07).astype(jnp.float32)
                for cta_heads, block_kv in settings:
                    fn = functools.partial(latent_decode_gpu, scale=0.07, cta_heads=cta_heads, block_kv=block_kv)
                    error = float(jnp.abs(fn(*args).astype(jnp.float32) - want).max())
                    timing = device_time(fn, args, 10, feed=1)
                    row = {
                        "shape": name,
                        "latent": rank,
                        "batch": batch,
                        "context": context,
                        "cta_heads": cta_heads,
                        "block_kv": block_kv,
                        "max_abs_error": error,
                        "time_s": timing["time_s"],
                        "kernels_s": timing["kernels_s"],
                        "method": timing["method"],
                        "tflops": flops / timing["time_s"] / 1e12,
                        **roofline.floor(0, cache_bytes, flops, ceilings, timing["time_s"]),
                    }
                    results.append(row)
                    print(
                        f"{name:9} batch={batch:<4} context={context:<6} cta_heads={cta_heads!s:<4} "
                        f"block_kv={block_kv!s:<5}{timing['time_s'] * 1e6:9.1f} us  {row['tflops']:6.1f} TFLOP/s  "
                        f"{row['time_over_floor']:.2f}x floor ({row['bound']})  error {error:.3g}",
                        flush=True,
                    )
                    save(out, "latent_kernel_heads", results)


# The split-KV merge's calls: (name, batch, blocks, splits, padded heads, heads, latent width): the heads mode's
# 128 heads at batch 64 (two splits), MLA's 128 at batch 32 (two), the 2.9B models at batch 1 and 8K (32 splits)
MERGE_SHAPES = (
    ("mlra4_tp4", 64, 1, 2, 128, 128, 128),
    ("mla_dp4", 32, 1, 2, 128, 128, 512),
    ("mlra4_2p9b_batch1", 1, 4, 32, 64, 24, 128),
    ("mla_2p9b_batch1", 1, 1, 32, 64, 24, 512),
)


def merge(out: Path) -> None:
    """The split-KV merge kernel (combine_gpu) per MERGE_SHAPES row with 1, 2, 4 and 8 heads a CTA (and the
    kernel's own choice), against its floor: the partials' and the output's bytes at the measured copy bandwidth."""
    ceilings, sms = roofline.measured_ceilings(), sm_count()
    results = []
    for name, batch, blocks, splits, padded, heads_n, rank in MERGE_SHAPES:
        keys = jax.random.split(jax.random.key(0), 2)
        partial_out = jax.random.normal(keys[0], (batch, blocks, splits, padded, rank), jnp.bfloat16)
        lse = jax.random.normal(keys[1], (batch, blocks, splits, padded)) * 4
        moved = batch * blocks * heads_n * (splits * (rank * 2 + 4) + rank * 2)
        want = combine(partial_out, lse, jnp.bfloat16)[:, :, :heads_n].astype(jnp.float32)
        for rows in (None, 1, 2, 4, 8):
            if rows and heads_n % rows:
                continue
            fn = jax.jit(functools.partial(combine_gpu, dtype=jnp.bfloat16, heads=heads_n, sms=sms, heads_per_cta=rows))
            error = float(jnp.abs(fn(partial_out, lse).astype(jnp.float32) - want).max())
            timing = profiled_time(lambda: fn(partial_out, lse), 20)  # one kernel a call: its span
            row = {
                "shape": name,
                "batch": batch,
                "blocks": blocks,
                "splits": splits,
                "heads": heads_n,
                "latent": rank,
                "heads_per_cta": rows,
                "chosen": combine_heads(partial_out.shape, heads_n, sms),
                "max_abs_error": error,
                "time_s": timing["time_s"],
                "method": "profiler span of one call, median of 20",
                **roofline.floor(0, moved, 0, ceilings, timing["time_s"]),
            }
            results.append(row)
            print(
                f"{name:18} heads_per_cta={rows!s:<4} (chosen {row['chosen']}) {timing['time_s'] * 1e6:7.2f} us  "
                f"{row['time_over_floor']:.2f}x floor  error {error:.3g}",
                flush=True,
            )
            save(out, "latent_kernel_merge", results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench latent_kernel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", nargs="?", choices=("check", "tune", "bound", "heads", "merge"), default="check")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON record of `bound`, `heads` or `merge` (default: experiments/results/latent_kernel_MODE.json)",
    )
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("the Mosaic GPU kernel runs on Hopper GPUs (the tests check its merge in interpret mode)")
    out = args.out or Path(f"experiments/results/latent_kernel_{args.mode}.json")
    modes = {
        "check": check,
        "tune": tune,
        "bound": lambda: bound(out),
        "heads": lambda: heads(out),
        "merge": lambda: merge(out),
    }
    modes[args.mode]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
