"""The latent family's batch-1 decode work around the attention kernel, as Pallas Triton kernels (GPUs).

One decode token of MLA, GLA or MLRA attends with absorbed weights (paper Steps 1-3). At batch 1 XLA runs
each small piece of that as its own kernel (the cache entry's norm, its RoPE and two cache writes; the
query's RoPE, its copy per latent block and the W_UK product; the W_UV product and the branch sum), each
costing 1.1-3 us on an H100 whatever its bytes. Here two kernels do it, with the model's roundings:

* latent_queries: W_UK absorbed into every block's queries, q_latent [n, H_b, R], and the roped q_rope of
  each block's heads [n, H_b, d_h^R]; n more programs write the token's cache entry (its latent blocks
  normalized and scaled, its RoPE key rotated) at its slot, in place (the caches are aliased to outputs);
* latent_output: W_UV applied to every block's attention output, the branches summed and scaled: the heads'
  output [h, d_h].

kv_up is the serving layout [2, n, H_b, R, d_h] (W_UK, W_UV, head-major). Block b = branch * groups + group
serves the heads group * H_b .. (group + 1) * H_b - 1 (attention.latent's layout); cos and sin are the
RoPE angles of the token's position [d_h^R / 2] (attention.rope). Each kernel has a jnp reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from mlra_jax.pallas_kernels.block_specs import whole_block

F32 = jnp.float32
QUERY_RANKS = 32  # latent ranks per program of latent_queries
OUTPUT_COLUMNS = 32  # value columns per program of latent_output
OUTPUT_RANKS = 128  # latent ranks per tile of latent_output


_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)


def _like(*arrays: jax.Array) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def _rotated(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """attention.rope's half-split rotation in float32."""
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def _rope_reference(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    x32 = x.astype(F32)
    return jnp.concatenate(_rotated(x32[..., :half], x32[..., half:], cos, sin), axis=-1).astype(x.dtype)


# -- the cache entry and the queries, one kernel ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LatentEntry:
    """What write_latent_entry needs besides the caches: x_proj's row `projected` (the latent at [offset, offset +
    n R), the RoPE key after it), the latent norm's scale [n, R] and eps, and the latent scale."""

    projected: jax.Array
    norm_scale: jax.Array
    offset: int
    eps: float
    latent_scale: float


def _write_entry(entry: LatentEntry, refs, block, slot, cos, sin) -> None:
    """Block `block`'s latent (normalized, scaled) into latent_ref at `slot`; with block 0, the roped key too."""
    x_ref, scale_ref, latent_ref, k_rope_ref = refs
    r, dr = latent_ref.shape[-1], k_rope_ref.shape[-1]
    half, n = dr // 2, latent_ref.shape[2]
    x = x_ref[pl.ds(entry.offset + block * r, r)].astype(F32)
    normed = (x * lax.rsqrt(jnp.sum(x * x) / r + entry.eps)).astype(entry.projected.dtype).astype(F32)
    latent_ref[0, slot, block, :] = (normed * scale_ref[block, :] * entry.latent_scale).astype(latent_ref.dtype)

    @pl.when(block == 0)
    def _rope():
        key = entry.offset + n * r
        y1, y2 = _rotated(x_ref[pl.ds(key, half)].astype(F32), x_ref[pl.ds(key + half, half)].astype(F32), cos, sin)
        k_rope_ref[0, slot, 0, pl.ds(0, half)] = y1.astype(entry.projected.dtype).astype(k_rope_ref.dtype)
        k_rope_ref[0, slot, 0, pl.ds(half, half)] = y2.astype(entry.projected.dtype).astype(k_rope_ref.dtype)


def _check_entry(entry: LatentEntry, latent_cache: jax.Array, k_rope_cache: jax.Array) -> None:
    _, _, n, r = latent_cache.shape
    need = entry.offset + n * r + k_rope_cache.shape[-1]
    if latent_cache.shape[0] != 1 or entry.projected.shape[0] < need:
        raise ValueError(
            f"the latent cache entry: one sequence's row of at least {need} values; got "
            f"{entry.projected.shape} and a cache of {latent_cache.shape}"
        )


def write_latent_entry_reference(entry: LatentEntry, cos, sin, latent_cache, k_rope_cache, slot):
    _, _, n, r = latent_cache.shape
    latent = entry.projected[entry.offset : entry.offset + n * r].reshape(n, r)
    x32 = latent.astype(F32)
    normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + entry.eps)).astype(latent.dtype)
    value = (normed * entry.norm_scale * entry.latent_scale).astype(latent_cache.dtype)
    start = entry.offset + n * r
    key = _rope_reference(entry.projected[start : start + k_rope_cache.shape[-1]], cos, sin)
    return (
        lax.dynamic_update_slice(latent_cache, value[None, None], (0, slot[0], 0, 0)),
        lax.dynamic_update_slice(k_rope_cache, key.astype(k_rope_cache.dtype)[None, None, None], (0, slot[0], 0, 0)),
    )


# -- latent_queries -----------------------------------------------------------------------------------------
def latent_queries(
    q: jax.Array,
    kv_up: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    branches: int,
    ranks: int = QUERY_RANKS,
    entry: LatentEntry | None = None,
    caches: tuple[jax.Array, ...] = (),
    slot: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """From q [h, d_h + d_h^R] (q_up's output: each head's q_nope then q_rope): q_latent [n, H_b, R], each block's
    heads' q_nope times W_UK, and q_rope [n, H_b, d_h^R], their q_rope rotated, both in q's dtype. A program takes
    `ranks` latent ranks of one block's head. With an entry, caches (latent, k_rope) and slot, n more programs
    write the token's cache entry as write_latent_entry does (one kernel less) and the caches are returned too."""
    h, width = q.shape
    _, n, heads, r, dh = kv_up.shape
    dr, groups, ranks = width - dh, n // branches, min(r, ranks)
    if groups * heads != h or r % ranks:
        raise ValueError(f"latent_queries: {h} heads do not match kv_up {kv_up.shape} with {branches} branches")
    half, parts = dr // 2, r // ranks
    entries = n if entry is not None else 0  # the first programs write the entry; the queries' come after them
    if entry is not None:
        _check_entry(entry, *caches)

    def kernel(q_ref, w_ref, cos_ref, sin_ref, *refs):
        program = pl.program_id(0)
        if entry is not None:
            x_ref, scale_ref, slot_ref, _latent_in, _k_rope_in, latent_ref, rope_ref, latent_cache, k_rope_cache = refs

            @pl.when(program < entries)
            def _entry():
                _write_entry(
                    entry,
                    (x_ref, scale_ref, latent_cache, k_rope_cache),
                    program,
                    slot_ref[0],
                    cos_ref[...],
                    sin_ref[...],
                )
        else:
            latent_ref, rope_ref = refs

        @pl.when(program >= entries)
        def _queries():
            query = program - entries
            block, head, part = query // (heads * parts), lax.rem(query // parts, heads), lax.rem(query, parts)
            row = lax.rem(block, groups) * heads + head
            q_nope = q_ref[row, pl.ds(0, dh)].astype(F32)
            w = w_ref[0, block, head, pl.ds(pl.multiple_of(part * ranks, ranks), ranks), :].astype(F32)
            latent_ref[block, head, pl.ds(pl.multiple_of(part * ranks, ranks), ranks)] = jnp.sum(
                w * q_nope[None, :], axis=1
            ).astype(latent_ref.dtype)

            @pl.when(part == 0)
            def _rope():
                x1, x2 = q_ref[row, pl.ds(dh, half)].astype(F32), q_ref[row, pl.ds(dh + half, half)].astype(F32)
                y1, y2 = _rotated(x1, x2, cos_ref[...], sin_ref[...])
                rope_ref[block, head, pl.ds(0, half)] = y1.astype(rope_ref.dtype)
                rope_ref[block, head, pl.ds(half, half)] = y2.astype(rope_ref.dtype)

    operands = [q, kv_up, cos, sin]
    out_shape = [jax.ShapeDtypeStruct((n, heads, r), q.dtype), jax.ShapeDtypeStruct((n, heads, dr), q.dtype)]
    aliases = {}
    if entry is not None:
        operands += [entry.projected, entry.norm_scale, slot, *caches]
        out_shape += _like(*caches)
        aliases = {len(operands) - 2: 2, len(operands) - 1: 3}
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(entries + n * heads * parts,),
        in_specs=[whole_block(a.shape) for a in operands],
        out_specs=tuple(whole_block(o.shape) for o in out_shape),
        input_output_aliases=aliases,
        compiler_params=_PARAMS,
        interpret=interpret,
        name="latent_queries",
    )(*operands)


def latent_queries_reference(q, kv_up, cos, sin, *, branches):
    _, n, heads, _, dh = kv_up.shape
    groups = n // branches
    per_block = jnp.tile(q.reshape(groups, heads, -1), (branches, 1, 1))  # block b reads group b % groups
    q_latent = jnp.einsum("nhk,nhrk->nhr", per_block[..., :dh], kv_up[0], preferred_element_type=F32)
    return q_latent.astype(q.dtype), _rope_reference(per_block[..., dh:], cos, sin)


# -- latent_output ------------------------------------------------------------------------------------------
def latent_output(
    z: jax.Array,
    kv_up: jax.Array,
    *,
    branches: int,
    branch_scale: float,
    columns: int = OUTPUT_COLUMNS,
    ranks: int = OUTPUT_RANKS,
    interpret: bool = False,
) -> jax.Array:
    """The heads' output [h, d_h] from the attention's z [n, H_b, R]: every block's z times its W_UV, rounded to
    W's dtype, the branches summed in float32 and scaled, rounded again (LatentAttention.merge_branches). A
    program takes `columns` of one head's values and loads all of its W_UV tiles ([ranks, columns] each) at once.
    (Merging the attention's split-KV partials in this kernel instead of their own merge kernel was slower on an
    H100: 7.4 us per 2.9B MLRA-4 layer against 1.8 + 4.5; for MLA the whole step was the same, 2.708 ms per token
    against 2.706.)"""
    n, heads, r = z.shape
    dh = kv_up.shape[-1]
    groups, ranks, columns = n // branches, min(r, ranks), min(dh, columns)

    def kernel(z_ref, w_ref, out_ref):
        head, part = pl.program_id(0), pl.program_id(1)
        group, block_head = head // heads, lax.rem(head, heads)
        values = pl.ds(pl.multiple_of(part * columns, columns), columns)
        tiles = [
            (
                branch,
                w_ref[1, branch * groups + group, block_head, pl.ds(r0, ranks), values],
                z_ref[branch * groups + group, block_head, pl.ds(r0, ranks)],
            )
            for branch in range(branches)
            for r0 in range(0, r, ranks)
        ]  # every load issued first
        accs = [jnp.zeros((ranks, columns), F32)] * branches
        for branch, w, zs in tiles:
            accs[branch] = accs[branch] + w.astype(F32) * zs.astype(F32)[:, None]
        total = jnp.zeros((columns,), F32)
        for acc in accs:
            total = total + jnp.sum(acc, axis=0).astype(kv_up.dtype).astype(F32)
        out_ref[...] = (total * branch_scale).astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((groups * heads, dh), kv_up.dtype),
        grid=(groups * heads, dh // columns),
        in_specs=[whole_block(z.shape), whole_block(kv_up.shape)],
        out_specs=pl.BlockSpec((None, columns), lambda i, j: (i, j)),
        compiler_params=_PARAMS,
        interpret=interpret,
        name="latent_output",
    )(z, kv_up)


def latent_output_reference(z, kv_up, *, branches, branch_scale):
    n, heads, _ = z.shape
    out = jnp.einsum("nhr,nhrk->nhk", z, kv_up[1], preferred_element_type=F32).astype(kv_up.dtype)
    out = out.reshape(branches, (n // branches) * heads, -1).astype(F32)
    return (out.sum(axis=0) * branch_scale).astype(kv_up.dtype)


def check_latent_shapes(q_rank: int, rank: int, rope: int, nope: int) -> None:
    """A ValueError unless these kernels and the row products take the latent layout: power-of-two widths (the
    shapes of Triton's tensors) and d_c' in multiples of 16."""
    for name, value in (("latent rank per block", rank), ("RoPE width / 2", rope // 2), ("d_h", nope)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"the latent row kernels need a power-of-two {name}; got {value}")
    if q_rank % 16:
        raise ValueError(f"the latent row kernels need d_c' in multiples of 16; got {q_rank}")
