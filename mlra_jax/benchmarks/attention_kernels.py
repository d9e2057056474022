"""The training attention core on an NVIDIA GPU: cuDNN (the trainer's kernel) against Pallas kernels (JAX's, ours).

    mlra bench attention_kernels --out=experiments/results/attention_kernels_h100.json

For each experiment's attention layer (its heads and key / value widths, sequences of its length):

* cuDNN's flash attention, causal, forward and forward + backward, bf16: what `attention_impl=auto` runs;
* `cudnn_fp8`: cuDNN's FP8 flash attention as a float8 train step runs it (`mlra_jax.attention.fp8_attention`: the e4m3
  quantizing passes, delayed scaling from an amax history that a first call filled, the outputs dequantized),
  causal, forward and forward + backward, beside cuDNN's bf16 on the same call with the layer's own KV heads
  (GQA's groups); each FP8 row holds its errors against the bf16 call's output or gradients and its speed-up;
* JAX's Pallas Triton flash attention (`jax.experimental.pallas.ops.gpu.attention`), causal, forward + backward,
  bf16, at a few tilings; it takes one head width, so the value is zero-padded to the key's;
* JAX's Mosaic GPU attention (`...ops.gpu.attention_mgpu`, FlashAttention-3's design), float16 only: causal
  forward, and forward + backward without a mask (it has no causal backward), beside cuDNN's on the same call;
* for MLRA-2 and MLRA-4 (`mlra`): our kernel (`mlra_jax.pallas_kernels.mlra_attention_gpu`), causal forward, bf16,
  on the absorbed layout, beside cuDNN's forward on the same inputs laid out as `latent_heads_attention` calls it
  (query heads [q_latent || q_rope] over one KV head [latent || k_rope] / latent per block); then forward +
  backward, ours (`mlra_attention_gpu_backward.mlra_attention`: the default forward and the backward kernels)
  beside cuDNN's on the same inputs and cotangent; each of our rows holds its errors (output, or the four inputs'
  gradients) against cuDNN's (every sequence) and against the float32 `jnp` reference (the first), and its
  speed-up over that cuDNN call. `--mlra_backward` times several of the backward's schedules side by side
  (`BackwardTuning.parse` spellings, e.g. `--mlra_backward=default,noskip+noprescale,dq_stages5`; each row's
  tiling names its own), cuDNN's forward + backward timed again after them to bracket drift;
  `--mlra_forward=default` keeps the forward's default tiling only.

Keys and values have as many heads as the queries, except in the `mlra` rows (`layout`). Each time is the
profiler's GPU span of one call, median of `--repeats`; the rate counts model FLOPs (2 (d_qk + d_v) per head per
visible key forward, 3x that forward + backward, as MFU does; our kernel's RoPE scores, shared by its branches,
count per branch). A kernel that cannot take a call is recorded with its error.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mlra_jax.attention import attention_class
from mlra_jax.attention.fused import cudnn_attention
from mlra_jax.benchmarks.common import experiment_list, profiled_time, save
from mlra_jax.config import Experiment, ModelConfig
from mlra_jax.experiments import get_experiment
from mlra_jax.pallas_kernels.mlra_attention_gpu import mlra_attention_gpu, mlra_attention_reference, plan
from mlra_jax.pallas_kernels.mlra_attention_gpu_backward import BackwardTuning, mlra_attention

TRITON_TILINGS = ((128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3))  # block_q, block_k, warps, stages
MOSAIC_TILINGS = ((64, 128, 2), (64, 64, 2))  # block_q, block_kv, concurrent steps
# our kernel's tilings: branches per CTA (None: its plan's, sharing the RoPE scores; 1: none shared), keys per stage,
# the two compute warpgroups' ping-pong, each warpgroup's overlap of P V with the next softmax; the default first
MLRA_TILINGS = ((1, 128, False, True), (1, 128, True, False), (1, 128, False, False), (None, 64, True, False))
KERNELS = ("cudnn", "cudnn_fp8", "pallas_triton", "mosaic_gpu", "mlra")


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
    """One row: the GPU time of fn(*args), its rate, each kernel's median time in us by name and the median call's
    kernels in order (name, us: our kernels share one name), or the error that stopped it."""
    try:
        timing = profiled_time(lambda: fn(*args), repeats)
    except Exception as error:  # a kernel that cannot take this call: recorded, the others still run
        return {**row, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    seconds = timing["time_s"]
    kernels_us = {name: round(s * 1e6, 1) for name, s in sorted(timing["kernels_s"].items(), key=lambda x: -x[1])}
    timeline_us = [(name[:60], duration) for name, _, duration in timing["timeline"]]
    return {
        **row,
        "time_s": seconds,
        "model_tflops_per_s": flops / seconds / 1e12,
        "kernels_us": kernels_us,
        "timeline_us": timeline_us,
    }


def case_rows(
    name: str,
    batch: int,
    repeats: int,
    kernels: tuple[str, ...] = KERNELS,
    mlra_backward: tuple[str, ...] = ("default",),
    mlra_forward: str = "all",
) -> list[dict[str, Any]]:
    """The rows of `kernels` (of KERNELS) for one experiment's attention layer; mlra_backward, mlra_forward: see
    mlra_rows (`tunings`, `forward_tilings`)."""
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
    rows = []
    if "cudnn" in kernels:
        rows.append(row("cudnn", jax.jit(cudnn), (q, k, v), True, dtype="bfloat16"))
        rows.append(row("cudnn", with_backward(cudnn), (q, k, v, do), True, dtype="bfloat16"))
    if "cudnn_fp8" in kernels:
        rows += fp8_rows(experiment.model, row, batch, length, scale)
    if "mlra" in kernels:
        rows += mlra_rows(experiment, batch, repeats, tunings=mlra_backward, forward_tilings=mlra_forward)
    if "pallas_triton" not in kernels and "mosaic_gpu" not in kernels:
        return rows
    from jax.experimental.pallas.ops.gpu import attention as triton_attention

    wide = (q, k, padded(v, dk), padded(do, dk))  # Triton's kernel takes one head width
    for block_q, block_k, warps, stages in TRITON_TILINGS if "pallas_triton" in kernels else ():
        tiles = dict(block_q=block_q, block_k=block_k, block_q_dkv=block_q, block_kv_dkv=block_k)
        blocks = triton_attention.BlockSizes(**tiles, block_q_dq=block_q, block_kv_dq=block_k)
        triton = lambda q, k, v, b=blocks, w=warps, s=stages: triton_attention.mha(  # noqa: E731
            q, k, v, None, scale, True, b, "triton", w, s
        )
        tiling = {"block_q": block_q, "block_k": block_k, "warps": warps, "stages": stages}
        rows.append(row("pallas_triton", with_backward(triton), wide, True, dtype="bfloat16", tiling=tiling))
    if "mosaic_gpu" not in kernels:
        return rows
    return rows + mosaic_rows(row, [x.astype(jnp.float16) for x in wide], padded_from=dv if dv < dk else None)


CALIBRATION_CALLS = 3  # FP8 attention calls that fill the history its timed call takes its scales from


def fp8_rows(model: ModelConfig, row: Callable[..., dict[str, Any]], batch: int, length: int, scale: float) -> list:
    """cuDNN's FP8 attention (fp8_attention.fp8_attention) and cuDNN's bf16 on the same causal call, forward and
    forward + backward, with the layer's KV heads; the FP8 rows hold their errors against bf16's and their
    speed-ups. The FP8 scales come from the history that CALIBRATION_CALLS calls on these inputs filled, each
    from the history of the one before, as a run's steps fill it (a fresh history's first call runs every scale
    at 1, which flushes most of the softmax probabilities of long rows to zero)."""
    from mlra_jax.attention import fp8_attention

    heads, dk, dv = attention_class(model.variant).core_shape(model)
    kv_heads = model.n_kv_head if model.spec.kv_heads is not None else heads
    q, k, v, do = layer_inputs(batch, heads, length, dk, dv, jnp.bfloat16)
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    labels = {"dtype": "bfloat16", "layout": f"{heads} query heads over {kv_heads} KV heads"}
    bf16 = lambda q, k, v: cudnn_attention(q, k, v, scale=scale)  # noqa: E731
    rows = [row("cudnn", jax.jit(bf16), (q, k, v), True, **labels)]
    rows.append(row("cudnn", with_backward(bf16), (q, k, v, do), True, **labels))
    try:
        history = fp8_attention.new_history()
        for _ in range(CALIBRATION_CALLS):
            history = jax.vjp(lambda *x: fp8_attention.fp8_attention(*x, scale), q, k, v, history)[1](do)[3]
    except Exception as error:  # no FP8 attention here: recorded, the other kernels still run
        failed = {key: value for key, value in rows[0].items() if key not in ("time_s", "model_tflops_per_s")}
        return [*rows, {**failed, "kernel": "cudnn_fp8", "error": f"{type(error).__name__}: {str(error)[:300]}"}]
    fp8 = lambda q, k, v: fp8_attention.fp8_attention(q, k, v, history, scale)  # noqa: E731
    labels = {**labels, "dtype": "float8_e4m3fn", "history": [float(a) for a in history[:, 0]]}
    for base, fn, args, want in (
        (rows[0], jax.jit(fp8), (q, k, v), lambda: (jax.jit(bf16)(q, k, v),)),
        (rows[1], with_backward(fp8), (q, k, v, do), lambda: with_backward(bf16)(q, k, v, do)),
    ):
        measured = row("cudnn_fp8", fn, args, True, **labels)
        if "time_s" in measured:
            got = fn(*args)
            got = got if isinstance(got, tuple) else (got,)
            for name, g, w in zip(("out",) if len(got) == 1 else ("dq", "dk", "dv"), got, want()):
                measured.update(errors(g, w, f"{name}_vs_cudnn"))
            if "time_s" in base:
                measured["cudnn_time_s"] = base["time_s"]
                measured["speedup_vs_cudnn"] = base["time_s"] / measured["time_s"]
        rows.append(measured)
    return rows


def mlra_layout(model: ModelConfig) -> dict[str, int] | None:
    """Our MLRA kernel's layout of an MLRA layer's training attention (the absorbed one): `groups` head groups,
    each of `blocks` latent blocks (the group's branches: blocks g, g + groups, ..., sharing the group's RoPE
    queries) serving `heads` query heads, the blocks `rank` wide, the RoPE key `rope`. None for a variant without
    branches, or where the blocks are not as wide as the trained heads' keys (the absorbed attention would then be
    another problem than the layer's)."""
    if model.spec.latent_layout is None:
        return None
    blocks, branches = model.spec.latent_layout
    rank = model.kv_lora_rank // blocks
    if branches == 1 or rank != model.qk_nope_head_dim:
        return None
    groups = blocks // branches
    heads, rope = model.n_head // groups, model.qk_rope_head_dim
    return {"groups": groups, "blocks": branches, "heads": heads, "rank": rank, "rope": rope}


def mlra_inputs(batch: int, length: int, layout: dict[str, int], dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    """Random kernel inputs for `batch` sequences: q_latent [G H, B, T, n, R] (head-major), q_rope [B, T, G H, Dr],
    latent [B, T, n G, R], k_rope [B, T, Dr] (G head groups of H heads, n branches)."""
    g, n, h, r, dr = layout["groups"], layout["blocks"], layout["heads"], layout["rank"], layout["rope"]
    keys = jax.random.split(jax.random.key(1), 4)
    shapes = ((g * h, batch, length, n, r), (batch, length, g * h, dr), (batch, length, n * g, r), (batch, length, dr))
    return tuple(jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes))


def heads_last(q: jax.Array, groups: int) -> jax.Array:
    """A query-side tensor of the kernel, [G H, B, T, n, R], as latent_heads_attention has it: [B, T, n G, H, R]
    (block c G + g, then its heads)."""
    heads, b, t, n, r = q.shape
    h = heads // groups
    return q.reshape(groups, h, b, t, n, r).transpose(2, 3, 4, 0, 1, 5).reshape(b, t, n * groups, h, r)


def heads_first(x: jax.Array, groups: int) -> jax.Array:
    """The inverse of heads_last."""
    b, t, blocks, h, r = x.shape
    n = blocks // groups
    return x.reshape(b, t, n, groups, h, r).transpose(3, 4, 0, 1, 2, 5).reshape(groups * h, b, t, n, r)


QUERY_SIDE = (0, 4)  # the positions of q_latent and the output's cotangent in (q_latent, q_rope, latent, k_rope, do)


def first_sequence(tensors: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The first sequence of each tensor (the query side's batch is its second axis)."""
    return tuple(x[:, :1] if i in QUERY_SIDE else x[:1] for i, x in enumerate(tensors))


def absorbed_qkv(
    q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, groups: int = 1
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's inputs as latent_heads_attention hands them to cuDNN: q [B, T, n G H, R + Dr], one KV head per
    block, k [B, S, n G, R + Dr] and v = latent [B, S, n G, R]."""
    q_latent = heads_last(q_latent, groups)
    b, t, blocks, h, r = q_latent.shape
    dr = q_rope.shape[-1]
    rope = q_rope.reshape(b, t, 1, groups, h, dr)  # each block c G + g: its group's RoPE queries
    rope = jnp.broadcast_to(rope, (b, t, blocks // groups, groups, h, dr)).reshape(b, t, blocks, h, dr)
    q = jnp.concatenate([q_latent, rope], axis=-1)
    k = jnp.concatenate([latent, jnp.broadcast_to(k_rope[:, :, None], (b, t, blocks, dr))], axis=-1)
    return q.reshape(b, t, blocks * h, r + dr), k, latent


def errors(out: jax.Array, want: jax.Array, suffix: str) -> dict[str, float]:
    """Max abs and relative (L2) error of out against want, as float32."""
    out, want = out.astype(jnp.float32), want.astype(jnp.float32)
    return {
        f"max_abs_error_{suffix}": float(jnp.max(jnp.abs(out - want))),
        f"relative_error_{suffix}": float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want)),
    }


def mlra_rows(
    experiment: Experiment,
    batch: int,
    repeats: int,
    interpret: bool = False,
    backward: bool = True,
    tunings: tuple[str, ...] = ("default",),
    forward_tilings: str = "all",
) -> list[dict[str, Any]]:
    """Our MLRA kernel's causal forward (bf16, each tiling of MLRA_TILINGS, or its first, the default, where
    forward_tilings is "default") beside cuDNN's forward on the same inputs and layout, then (`backward`) both
    forward + backward (mlra_backward_rows, one row of ours per backward tuning); no rows for a layer that
    mlra_layout does not take. interpret=True runs our kernels in Pallas's GPU interpreter (the tests, on CPU)."""
    model = experiment.model
    layout = mlra_layout(model)
    if layout is None:
        return []
    heads, dk, dv = attention_class(model.variant).core_shape(model)
    length, scale = experiment.train.seq_len, dk**-0.5
    flops = model_flops(batch, heads, length, dk, dv, causal=True, backward=False)
    kv_heads = layout["groups"] * layout["blocks"]
    labels = {
        "mask": "causal",
        "passes": "forward",
        "dtype": "bfloat16",
        "layout": f"absorbed: {kv_heads} KV heads of {layout['heads']} query heads, RoPE shared by {layout['blocks']}",
        "experiment": experiment.name,
        "batch": batch,
        "heads": heads,
        "seq_len": length,
        "dk": dk,
        "dv": dv,
    }
    args, groups = mlra_inputs(batch, length, layout, jnp.bfloat16), layout["groups"]
    q, k, v = absorbed_qkv(*args, groups=groups)
    cudnn = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, scale=scale))
    base = measure(cudnn, (q, k, v), flops, repeats, kernel="cudnn", **labels)
    with jax.default_matmul_precision("highest"):  # the first sequence, all its head groups
        reference = functools.partial(mlra_attention_reference, scale=scale, groups=groups)
        want, want_lse = jax.jit(reference)(*first_sequence(args))
    theirs = None
    if "time_s" in base:
        theirs = heads_first(cudnn(q, k, v).reshape(heads_last(args[0], groups).shape), groups)
        base.update(errors(theirs[:, :1], want, "vs_reference"))
    rows, tried = [base], set()
    for branches, block_kv, pingpong, overlap in MLRA_TILINGS[:1] if forward_tilings == "default" else MLRA_TILINGS:
        try:
            per_cta, stages = plan(layout["blocks"], layout["rank"], layout["rope"], branches, block_kv)
        except ValueError as error:
            tiling = {"branches": branches, "block_kv": block_kv, "pingpong": pingpong, "overlap": overlap}
            rows.append({"kernel": "mlra_mosaic_gpu", **labels, "tiling": tiling, "error": str(error)})
            continue
        if (per_cta, block_kv, pingpong, overlap) in tried:
            continue
        tried.add((per_cta, block_kv, pingpong, overlap))
        attend = functools.partial(
            mlra_attention_gpu,
            scale=scale,
            groups=groups,
            branches=per_cta,
            block_kv=block_kv,
            pingpong=pingpong,
            overlap=overlap,
            interpret=interpret,
        )
        fn = jax.jit(attend)
        tiling = {"branches": per_cta, "block_kv": block_kv, "stages": stages, "pingpong": pingpong, "overlap": overlap}
        row = measure(fn, args, flops, repeats, kernel="mlra_mosaic_gpu", tiling=tiling, **labels)
        if "time_s" in row:
            out, lse = fn(*args)
            row["finite"] = bool(jnp.isfinite(out.astype(jnp.float32)).all() and jnp.isfinite(lse).all())
            row.update(errors(out[:, :1], want, "vs_reference"))
            row["lse_max_abs_error_vs_reference"] = float(jnp.max(jnp.abs(lse[:1] - want_lse)))
            if theirs is not None:
                row.update(errors(out, theirs, "vs_cudnn"))
                row["cudnn_time_s"] = base["time_s"]
                row["speedup_vs_cudnn"] = base["time_s"] / row["time_s"]
        rows.append(row)
    if not backward:
        return rows
    return rows + mlra_backward_rows(args, scale, flops * 3, repeats, labels, interpret, tunings, groups)


def mlra_backward_rows(
    args: tuple[jax.Array, ...],
    scale: float,
    flops: float,
    repeats: int,
    labels: dict[str, Any],
    interpret: bool,
    tunings: tuple[str, ...] = ("default",),
    groups: int = 1,
) -> list[dict[str, Any]]:
    """Forward + backward (the gradients of sum(out * do) for every input) of cuDNN on the absorbed layout and of
    ours (`mlra_attention`: the default forward and the backward kernels, one row per backward tuning, a
    BackwardTuning.parse spelling) on the same inputs and cotangent; each of our rows holds its gradients' errors
    against cuDNN's (mapped back to the kernel's four inputs through absorbed_qkv) and against the float32 `jnp`
    reference's (the first sequence). With several tunings cuDNN's row is timed again after ours (drift)."""
    do = jax.random.normal(jax.random.key(2), args[0].shape, args[0].dtype)
    labels = {**labels, "passes": "forward+backward"}
    q, k, v = absorbed_qkv(*args, groups=groups)
    cudnn = lambda q, k, v: cudnn_attention(q, k, v, scale=scale)  # noqa: E731

    def cudnn_row(**extra: Any) -> dict[str, Any]:
        cotangent = heads_last(do, groups).reshape(q.shape[:3] + do.shape[-1:])
        return measure(with_backward(cudnn), (q, k, v, cotangent), flops, repeats, kernel="cudnn", **labels, **extra)

    def gradients(attend):
        def loss(*inputs):
            return jnp.sum(attend(*inputs[:4]).astype(jnp.float32) * inputs[4].astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    names = ("d_q_latent", "d_q_rope", "d_latent", "d_k_rope")
    base, rows, want, theirs = cudnn_row(), [], None, None
    for spec in tunings:
        tuning = BackwardTuning.parse(spec)  # (a misspelt tuning fails before anything runs)
        tiling = {"backward_tile": 64, "backward": spec}
        ours = gradients(
            functools.partial(mlra_attention, scale=scale, groups=groups, tuning=tuning, interpret=interpret)
        )
        row = measure(ours, (*args, do), flops, repeats, kernel="mlra_mosaic_gpu", tiling=tiling, **labels)
        rows.append(row)
        if "time_s" not in row:
            continue
        got = ours(*args, do)
        if want is None:
            with jax.default_matmul_precision("highest"):
                reference = lambda *x: mlra_attention_reference(*x, scale=scale, groups=groups)[0]  # noqa: E731
                want = gradients(reference)(*(x.astype(jnp.float32) for x in first_sequence((*args, do))))
        row["finite"] = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in got)
        for name, g, w in zip(names, first_sequence(got), want):
            row.update(errors(g, w, f"{name}_vs_reference"))
        if "time_s" in base:
            if theirs is None:

                def cudnn_heads_first(*x):
                    out = cudnn(*absorbed_qkv(*x, groups=groups))
                    return heads_first(out.reshape(heads_last(x[0], groups).shape), groups)

                theirs = gradients(cudnn_heads_first)(*args, do)
            for name, g, w in zip(names, got, theirs):
                row.update(errors(g, w, f"{name}_vs_cudnn"))
            row["cudnn_time_s"] = base["time_s"]
            row["speedup_vs_cudnn"] = base["time_s"] / row["time_s"]
    if len(tunings) > 1:  # cuDNN again: the drift over our rows
        rows.append(cudnn_row(repeat="after the backward tunings"))
    return [base, *rows]


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
    parser.add_argument(
        "--kernels",
        default=",".join(KERNELS),
        help=f"comma-separated kernels to time, of {', '.join(KERNELS)} (mlra: ours beside cuDNN, MLRA layers only)",
    )
    parser.add_argument(
        "--mlra_backward",
        default="default",
        help="comma-separated schedules of our backward kernels to time side by side (mlra), each words of "
        "default, noskip, noprescale, skip, prescale, stagesN, dkv_stagesN, dq_stagesN joined by '+' "
        "(BackwardTuning.parse)",
    )
    parser.add_argument(
        "--mlra_forward",
        choices=("all", "default"),
        default="all",
        help="our forward's tilings to time (mlra): all of MLRA_TILINGS, or the default only",
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per call")
    parser.add_argument("--repeats", type=int, default=10, help="profiled calls per row (the median is kept)")
    parser.add_argument(
        "--out", type=Path, default=Path("experiments/results/attention_kernels.json"), help="the JSON record"
    )
    args = parser.parse_args(argv)
    names = experiment_list(parser, args.experiments)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be at least 1")
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if not kernels or set(kernels) - set(KERNELS):
        parser.error(f"--kernels={args.kernels!r}: name some of {', '.join(KERNELS)}")
    mlra_backward = tuple(spec for spec in args.mlra_backward.split(",") if spec)
    try:
        for spec in mlra_backward or ("",):
            BackwardTuning.parse(spec)
    except ValueError as error:
        parser.error(f"--mlra_backward: {error}")
    if jax.default_backend() != "gpu":
        parser.error(
            f"cuDNN and the Pallas GPU kernels need an NVIDIA GPU; this machine's backend is {jax.default_backend()!r}"
        )
    results = []
    for name in names:
        for row in case_rows(name, args.batch, args.repeats, kernels, mlra_backward, args.mlra_forward):
            results.append(row)
            rate = f"{row['model_tflops_per_s']:6.1f} TFLOP/s" if "time_s" in row else row["error"][:90]
            if "speedup_vs_cudnn" in row:
                error = max(v for key, v in row.items() if key.startswith("max_abs_error") and key.endswith("cudnn"))
                rate += f" {row['speedup_vs_cudnn']:.2f}x cuDNN, max error {error:.3g}"
            label = row.get("tiling", row.get("repeat", ""))
            print(
                f"{name:11} {row['kernel']:13} {row['mask']:6} {row['passes']:16} {label!s:60} {rate}",
                flush=True,
            )
            save(args.out, "attention_kernels", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
