"""GQA decode attention as a Pallas Triton kernel (NVIDIA GPUs): flash-decoding over the cache as stored.

One new token per sequence. q [B, K, G, D] holds the G query heads that read each of the K KV heads (GQA's
head i reads KV head i // G), k and v [B, S, K, D] are the cache as the model stores it (attention.gqa), and
sequence b attends over its slots [starts[b], ends[b]) (kv_cache.slot_mask's range; slots outside it are
masked out as the XLA path masks them, and must hold finite values, as a zero-initialized cache does).

A program takes one (sequence, KV head, KV split, head block): it loads each [block_s, D] tile of that KV
head's keys and values once for all of its query heads (their rows padded to at least 16, the smallest
tensor-core product), scores them with one tl.dot, and keeps float32 softmax statistics in the log2 domain
(an online softmax over the tiles of its split). Only the tiles that hold slots of the sequence's range are
read, so a cache much longer than the context costs nothing. With several splits each program writes its
normalized partial output and log2-sum-exp, and latent_decode_common.combine merges them; with one split the
program writes the output itself. `gqa_decode_reference` is the same math in jnp (the XLA path's roundings:
float32 scores and softmax, probabilities rounded to the value dtype before the product).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from mlra_jax.pallas_kernels.latent_decode_common import LOG2E, combine

F32 = jnp.float32
MIN_ROWS = 16  # the smallest M of a tensor-core product: fewer query heads are padded to it
MAX_ROWS = 64  # query heads per program at most (more take several head blocks)
DEFAULT_SMS = 132  # an H100 SXM, where the device reports no SM count (interpret mode on a CPU)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """block_s: cache slots per tile; splits: KV splits per (sequence, KV head), 0 to fill the GPU's SMs;
    num_warps, num_stages: Triton's warps per program and software-pipeline depth of the tile loads."""

    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 3
    splits: int = 0

    def __post_init__(self) -> None:
        if self.block_s < 16 or self.block_s & (self.block_s - 1) or min(self.num_warps, self.num_stages) < 1:
            raise ValueError(f"a GQA decode tiling takes a power-of-two block_s >= 16 and positive counts; got {self}")
        if self.splits < 0:
            raise ValueError(f"splits must be >= 0 (0: chosen for the GPU); got {self.splits}")


DEFAULT_TILING = Tiling()


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def head_rows(groups: int) -> tuple[int, int]:
    """(rows per program, head blocks) for G query heads per KV head: G padded to a power of two of at least
    MIN_ROWS, in blocks of at most MAX_ROWS."""
    rows = min(max(_power_of_two_at_least(groups), MIN_ROWS), MAX_ROWS)
    return rows, -(-groups // rows)


def sm_count(device: jax.Device | None = None) -> int:
    device = device if device is not None else jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_SMS


def choose_splits(programs: int, slots: int, block_s: int, sms: int) -> int:
    """KV splits per (sequence, KV head, head block): none where the programs already fill every SM (batch 64 x 4
    KV heads: 256 programs, about two per SM of an H100), else enough for about two per SM, each of at least 4
    tiles."""
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), pl.cdiv(slots, 4 * block_s)))


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array, ends: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"GQA decode takes q [B, K, G, D] and k, v [B, S, K, D]; got {q.shape}, {k.shape}, {v.shape}")
    b, kv, _, d = q.shape
    if k.shape[0] != b or k.shape[2] != kv or k.shape[3] != d:
        raise ValueError(f"q {q.shape} does not match the cache {k.shape} (batch, KV heads, head dim)")
    if d < 16 or d & (d - 1):
        raise ValueError(f"the GQA decode kernel takes a power-of-two head dim of at least 16; got {d}")
    if starts.shape != (b,) or ends.shape != (b,):
        raise ValueError(f"starts and ends must be [{b}]; got {starts.shape}, {ends.shape}")


def _kernel(starts_ref, ends_ref, q_ref, k_ref, v_ref, *out_refs, scale, block_s, splits, slots, final):
    split = pl.program_id(2)
    start, end = starts_ref[...], ends_ref[...]
    first = start // block_s
    tiles = jnp.maximum(pl.cdiv(end, block_s) - first, 0)
    per_split = pl.cdiv(tiles, splits)
    lo = first + split * per_split
    hi = jnp.minimum(first + tiles, lo + per_split)

    q = q_ref[...]  # [rows, D], read once
    rows, d = q.shape
    offsets = lax.broadcasted_iota(jnp.int32, (block_s,), 0)

    def body(tile, carry):
        acc, top, total = carry
        s0 = pl.multiple_of(tile * block_s, block_s)
        index = s0 + offsets
        if slots % block_s:  # the last tile of a cache of S slots, S not a multiple of block_s, reads past it
            inside = (index < slots)[:, None]
            k = pltriton.load(k_ref.at[pl.ds(s0, block_s), :], mask=inside, other=0)
            v = pltriton.load(v_ref.at[pl.ds(s0, block_s), :], mask=inside, other=0)
        else:
            k, v = k_ref[pl.ds(s0, block_s), :], v_ref[pl.ds(s0, block_s), :]
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * (scale * LOG2E)
        valid = ((index >= start) & (index < end))[None, :]
        logits = jnp.where(valid, logits, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(logits, axis=1))  # finite: every tile read holds a slot of the range
        correction = jnp.exp2(top - new_top)
        p = jnp.exp2(logits - new_top[:, None])
        total = total * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32
        )
        return acc, new_top, total

    init = (jnp.zeros((rows, d), F32), jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32))
    acc, top, total = lax.fori_loop(lo, hi, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]  # an empty split (or range) gives zeros
    if final:
        (out_ref,) = out_refs
        out_ref[...] = out.astype(out_ref.dtype)
    else:
        out_ref, lse_ref = out_refs
        out_ref[...] = out
        lse_ref[...] = top + jnp.log2(total)  # -inf for an empty split, which the merge weighs 0


@functools.partial(jax.jit, static_argnames=("scale", "tiling", "interpret"))
def gqa_decode_gpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    *,
    scale: float,
    tiling: Tiling = DEFAULT_TILING,
    interpret: bool = False,
) -> jax.Array:
    """q [B, K, G, D], k and v [B, S, K, D], starts and ends [B] -> [B, K, G, D] in v's dtype."""
    check_shapes(q, k, v, starts, ends)
    b, kv, groups, d = q.shape
    slots = k.shape[1]
    rows, head_blocks = head_rows(groups)
    splits = tiling.splits or choose_splits(b * kv * head_blocks, slots, tiling.block_s, sm_count())
    padded = head_blocks * rows
    if padded != groups:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - groups), (0, 0)))
    final = splits == 1
    grid = (b, kv * head_blocks, splits)

    def q_index(i, p, j):
        return i, p // head_blocks, p % head_blocks, 0

    def kv_index(i, p, j):
        return i, 0, p // head_blocks, 0

    in_specs = [
        pl.BlockSpec((None,), lambda i, p, j: (i,)),
        pl.BlockSpec((None,), lambda i, p, j: (i,)),
        pl.BlockSpec((None, None, rows, d), q_index),
        pl.BlockSpec((None, slots, None, d), kv_index),
        pl.BlockSpec((None, slots, None, d), kv_index),
    ]
    if final:
        out_shape = [jax.ShapeDtypeStruct((b, kv, padded, d), v.dtype)]
        out_specs = [pl.BlockSpec((None, None, rows, d), q_index)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((b, kv, splits, padded, d), F32),
            jax.ShapeDtypeStruct((b, kv, splits, padded), F32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, d), lambda i, p, j: (i, p // head_blocks, j, p % head_blocks, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, p, j: (i, p // head_blocks, j, p % head_blocks)),
        ]
    kernel = functools.partial(_kernel, scale=scale, block_s=tiling.block_s, splits=splits, slots=slots, final=final)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="gqa_decode",
    )(starts.astype(jnp.int32), ends.astype(jnp.int32), q, k, v)
    out = outs[0] if final else combine(outs[0], outs[1], v.dtype)
    return out[:, :, :groups]


def gqa_decode_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array, ends: jax.Array, *, scale: float
) -> jax.Array:
    """The kernel's definition in jnp, with the XLA path's roundings: q [B, K, G, D], k and v [B, S, K, D],
    starts and ends [B] -> [B, K, G, D] in v's dtype."""
    logits = jnp.einsum("bkgd,bskd->bkgs", q, k, preferred_element_type=F32) * scale
    slots = jnp.arange(k.shape[1])
    valid = (slots[None] >= starts[:, None]) & (slots[None] < ends[:, None])
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgs,bskd->bkgd", probs, v, preferred_element_type=F32).astype(v.dtype)
