"""MLRA's causal training attention, forward, as a Pallas Mosaic GPU kernel for Hopper (H100/H200).

The absorbed layout (mlra_jax.attention.latent, `absorbed_attention` / `latent_heads_attention`): n latent blocks
(branches), each one KV head of key [latent_j || k_rope] (R + Dr wide) and value latent_j (R), serving H query
heads [q_latent_j || q_rope]. The RoPE key k_rope and the query's RoPE part q_rope are the same for every branch
(MLRA-4: 4 blocks, 4 branches, one head group), so for each (query tile, key tile) the RoPE scores q_r . k_r are
computed once and every branch's latent scores are added to them:

    s_j = (q_rope k_rope^T) + q_latent_j latent_j^T,   out_j = softmax(scale * s_j, causal) latent_j.

Shapes: q_latent [H, B, T, n, R], q_rope [B, T, H, Dr], latent [B, S, n, R], k_rope [B, S, Dr] -> out
[H, B, T, n, R] and the natural-log logsumexp of the scaled logits [B, n, H, T] (float32, for the backward).
Causal with T == S (training). The query side is head-major ([H, B, T, n, R]) because that is how the products
around the attention make and take it: W_UK's product, batched over the heads, writes q_latent so, and W_UV's
reads the output so; any other order costs a transposed copy of each on every layer, forward and backward.
With G head groups (`groups`; MLRA-2 has two), the heads are [G H], q_rope [B, T, G H, Dr] and latent
[B, S, n G, R]: head g H + i attends with its branch c over block c G + g, as the model lays the blocks out.

Design (FlashAttention-3's forward, jax.experimental.pallas.ops.gpu.attention_mgpu, with MLRA's sharing):
  * A CTA takes one (head, group of `branches` latent blocks, 128 queries, sequence): two compute warpgroups of
    64 query rows each (wgmma's M) and one memory warpgroup.
  * Each compute warpgroup loads its q_rope tile and its branches' q_latent tiles by TMA once. The memory
    warpgroup streams tiles of `block_kv` keys (128 by default, or 64) by TMA through `stages` SMEM slots: the
    k_rope tile once and each branch's latent tile (which is its key and its value: read once, used twice), with
    a barrier per slot for "loaded" and one for "consumed" (both compute warpgroups arrive).
  * One branch per CTA (the default): per key tile one accumulator takes [q_latent || q_rope] [latent ||
    k_rope]^T (wgmma, K = R + Dr), then an online softmax in the log2 domain (the scale folded into exp2's
    argument, one FMA an element) and P latent (wgmma, P from registers). `overlap` (the default with one
    branch; FA3's intra-warpgroup overlap): a warpgroup issues tile i's scores together with tile i - 1's
    P latent, waits for the scores only, and runs tile i's softmax while that P latent runs; the running output
    is rescaled once P latent is done.
  * Several branches per CTA (`branches`, `plan`): per key tile the RoPE scores q_r k_r^T once (wgmma, K = Dr)
    and, per branch, its latent scores accumulated onto them (K = R), its own softmax and P latent_j: the RoPE
    product is 1/`branches` of what separate attentions spend on it. `plan` takes the most branches whose
    accumulators fit 256 float32 columns per warpgroup: 2 at R = 128 (MLRA-4 2.9B, 64-key tiles), 4 at R = 64.
  * `pingpong` (FA3's schedule between the two warpgroups, as attention_mgpu): a barrier of two arrivals, met
    twice per branch and key tile by each warpgroup (after issuing the scores, after the softmax), so that one
    warpgroup's softmax runs while the other's wgmma do.
  * Causal tile skipping: a warpgroup's rows [q0, q0 + 64) read the key tiles up to the one holding key q0 + 63;
    the tiles below the diagonal run unmasked, the last one masked. The memory warpgroup loads the tiles of the
    CTA's last rows; the first warpgroup waits on (and releases) the tiles it skips, taking its ping-pong turns
    through them, so that every barrier phase is observed in order.
  * Output: each warpgroup normalizes, writes its rows into its query SMEM (no longer read) and copies them out
    by TMA; the logsumexp likewise.

On an H100 (jax 0.11; `mlra bench attention_kernels --kernels=mlra`, experiments/results/
attention_kernels_mlra_h100_v2.json) it matches its reference and cuDNN at the 2.9B MLRA-4 and MLRA-2 layers; the
defaults (1 branch, 128-key tiles, overlap, no ping-pong) ran fastest of the tilings measured, 1.09x and 1.10x
cuDNN's forward on the same inputs. ptxas reports 168 registers at entry; the default spills 8 bytes a thread
(spill stores), the 2-branch plan at R = 128 204 and 4 branches at R = 64 596 (both measured with the row sum
after the ping-pong's turn); 2 branches run slower than one. Ping-pong together with the overlap ran slower
than either alone.
The accumulators' scopes index their SMEM tiles inside the scope (`_scores`, `_values`): under jax 0.11 a view
made outside and closed over by `pl.run_state` fails to lower.

Interpret mode (Pallas's Mosaic GPU interpreter on CPU, `interpret=True`; jax 0.10): it runs this kernel's
threads, barriers, TMA copies between GMEM and SMEM, SMEM reads and writes, the pipeline's slots and phases,
causal tile skipping and masking, the softmax and the stores, and it checks that every barrier phase is
observed (it raises on a skipped phase). It cannot run five Hopper-only pieces, which `interpret=True` replaces
by the same arithmetic on the same SMEM data, in the same order:
  1. wgmma with a transposed B operand (`plgpu.transpose_ref`: the interpreter's wgmma reads B untransposed);
  2. wgmma with the A operand in registers (P in P latent_j);
  3. `pl.run_state` over a wgmma accumulator (accumulating onto the RoPE scores and the running output);
  4. register layouts (`plgpu.layout_cast`, `plgpu.broadcasted_iota(layout=...)`: no CPU lowering);
  5. the overlap's accumulators kept in flight across the key loop (`pl.run_scoped` over the output's, waits on
     some wgmma groups only: `plgpu.wgmma_accumulator_load(..., wait_n=...)`; there the output is carried).
In interpret mode the products are float32 jnp.dot of the operands read from SMEM (`_scores`, `_values`), the
layouts plain arrays; those five, the register budget, the 128-byte swizzle of bf16 tiles (the interpreter
ignores transforms) and the speed are checked on the GPU only (the benchmark's rows carry their errors). Float32
inputs run only in interpret mode (the tests' exact comparison); the GPU takes bf16 or f16.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from mlra_jax.pallas_kernels.gpu_interpret import interpret_params

CHUNK = 64  # columns per SMEM tile (the 128-byte swizzle of bf16) and per value accumulator
BLOCK_Q = 64  # query rows per compute warpgroup (wgmma's M)
BLOCK_KV = 128  # keys per pipeline stage (the default, the fastest measured; 64 also runs)
COMPUTE_WGS = 2
SMEM_BYTES = 220 * 1024
MAX_ACC_COLUMNS = 256  # float32 accumulator columns per warpgroup: 128 registers a thread
MAX_STAGES = 4
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# the softmax's row sum before the ping-pong's hand-over (attention_mgpu's order for head widths <= 128) or after
SUM_BEFORE_TURN = True


def mlra_attention_reference(
    q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, *, scale: float, groups: int = 1
) -> tuple[jax.Array, jax.Array]:
    """The kernel's definition in plain jnp: causal attention of [q_latent_j || q_rope] over keys
    [latent_j || k_rope] and values latent_j per block j, float32 logits and softmax; (out [G H, B, T, n, R] in the
    inputs' dtype, logsumexp [B, n, G H, T] float32 of the scaled logits). With G `groups`, head g H + i takes
    branch c of block c G + g (latent [B, S, n G, R])."""
    f32 = jnp.float32
    heads, b, t, n, r = q_latent.shape
    s = latent.shape[1]
    q = q_latent.reshape(groups, heads // groups, b, t, n, r).astype(f32)
    lat = latent.reshape(b, s, n, groups, r).astype(f32)
    logits = jnp.einsum("gibtnr,bsngr->bngits", q, lat).reshape(b, n, heads, t, s)
    logits = logits + jnp.einsum("bthd,bsd->bhts", q_rope.astype(f32), k_rope.astype(f32))[:, None]
    logits = logits * scale
    causal = jnp.arange(t)[:, None] >= jnp.arange(s)[None, :]
    logits = jnp.where(causal, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None]).reshape(b, n, groups, heads // groups, t, s)
    out = jnp.einsum("bngits,bsngr->gibtnr", probs, lat).reshape(heads, b, t, n, r)
    return out.astype(latent.dtype), lse


def plan(blocks: int, rank: int, rope: int, branches: int | None = None, block_kv: int = BLOCK_KV) -> tuple[int, int]:
    """(branches per CTA, pipeline stages of block_kv keys): the most branches (dividing the blocks) whose
    accumulators fit MAX_ACC_COLUMNS and whose query tiles leave SMEM for at least two key stages (sized for
    bf16)."""
    candidates = [branches] if branches else [d for d in (4, 2, 1) if blocks % d == 0 and d * rank <= MAX_ACC_COLUMNS]
    for d in candidates:
        if blocks % d:
            raise ValueError(f"branches={d} does not divide the {blocks} latent blocks")
        columns = rope + d * rank
        q_bytes = COMPUTE_WGS * BLOCK_Q * columns * 2 + COMPUTE_WGS * d * BLOCK_Q * 4
        stages = (SMEM_BYTES - q_bytes) // (block_kv * columns * 2)
        if stages >= 2:
            return d, min(stages, MAX_STAGES)
    raise ValueError(f"latent blocks of {rank} with RoPE {rope} do not fit the pipeline in shared memory")


def _layout(x: jax.Array, layout, interpret: bool) -> jax.Array:
    return x if interpret else plgpu.layout_cast(x, layout)


def _columns(shape: tuple[int, int], interpret: bool) -> jax.Array:
    """Each element's column index, in the wgmma accumulator's layout."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, 1)
    return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)


def _rows(shape: tuple[int, int], interpret: bool) -> jax.Array:
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, 0)
    return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)


def _scores(
    pairs: Callable[[], list],
    init: jax.Array | None,
    interpret: bool,
    block_kv: int,
    issued: Callable[[], None] | None = None,
) -> jax.Array:
    """init (or zeros) + sum of a b^T over the pairs() of SMEM tiles a [64, CHUNK] (queries), b [block_kv, CHUNK]
    (keys): wgmma with b transposed on the GPU; float32 products of the SMEM contents in interpret mode. The tiles
    are indexed inside the accumulator's scope (`pairs` is called there): a view made outside and closed over
    brings its static indices into `pl.run_state` as operands, which Mosaic GPU (jax 0.11) cannot pass through.
    issued() runs once the products are issued, before they are awaited (the ping-pong hand-over)."""
    if interpret:
        total = init
        for a, b in pairs():
            product = lax.dot_general(
                a[...], b[...], (((1,), (1,)), ((), ())), precision="highest", preferred_element_type=jnp.float32
            )
            total = product if total is None else total + product
        if issued is not None:
            issued()
        return total

    def body(acc_ref):
        for a, b in pairs():
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b, (1, 0)))
        if issued is not None:
            issued()

    if init is None:

        def scoped(acc_ref):
            body(acc_ref)
            return acc_ref[...]

        return pl.run_scoped(scoped, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
    return pl.run_state(body)(plgpu.ACC.init(init))


def _values(
    accs: tuple[jax.Array, ...],
    p: jax.Array,
    values: Callable[[], list],
    interpret: bool,
    issued: Callable[[], None] | None = None,
) -> tuple[jax.Array, ...]:
    """accs[c] + p values()[c] for the value chunks values()[c] [block_kv, CHUNK] in SMEM (indexed inside the
    accumulators' scope, as in `_scores`), p [64, block_kv] in registers: wgmma with A from registers on the
    GPU. issued() runs while the products are in flight (the wait for the next key tile)."""
    if interpret:
        out = tuple(
            acc + jnp.dot(p, v[...], precision="highest", preferred_element_type=jnp.float32)
            for acc, v in zip(accs, values())
        )
        if issued is not None:
            issued()
        return out

    def body(acc_refs):
        for acc_ref, v in zip(acc_refs, values()):
            plgpu.wgmma(acc_ref, p, v)
        if issued is not None:
            issued()

    return pl.run_state(body)(tuple(plgpu.ACC.init(a) for a in accs))


def stream_tiles(fetch: Callable[[Any, Any], None], consumed: Any, stages: int, first: int, steps: Any) -> None:
    """The memory warpgroup's pipeline, inside a kernel: tiles 0..first-1 (those below `steps`) fetched into slots
    0..first-1, then tile i + stages into slot i mod stages once the compute warpgroups release it (`consumed`);
    fetch(tile, slot) issues one tile's copies."""
    for i in range(first):
        pl.when(i < steps)(functools.partial(fetch, i, i))

    @pl.loop(0, jnp.maximum(steps - stages, 0))
    def _refill(i):
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(consumed.at[slot])
        fetch(i + stages, slot)


@functools.partial(
    jax.jit, static_argnames=("scale", "groups", "branches", "block_kv", "pingpong", "overlap", "interpret")
)
def mlra_attention_gpu(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    *,
    scale: float,
    groups: int = 1,
    branches: int | None = 1,
    block_kv: int = BLOCK_KV,
    pingpong: bool = False,
    overlap: bool | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Causal MLRA attention forward: q_latent [H, B, T, n, R], q_rope [B, T, H, Dr] (every block's), latent
    [B, S, n, R], k_rope [B, S, Dr] -> (out [H, B, T, n, R], logsumexp [B, n, H, T] float32), as
    mlra_attention_reference. branches: latent blocks per CTA sharing the RoPE scores (1: none shared, the
    default; None: `plan`'s most); block_kv: keys per pipeline stage, 64 or 128; pingpong: the two compute
    warpgroups take turns on the tensor cores (FA3's schedule); overlap (one branch only): each warpgroup issues a
    key tile's scores with the previous tile's P V and runs its softmax while that P V does (FA3's intra-warpgroup
    overlap). groups: head groups G, as in mlra_attention_reference (q_latent [G H, B, T, n, R], q_rope
    [B, T, G H, Dr], latent [B, S, n G, R]; MLRA-2's two).
    interpret=True runs it in Pallas's GPU interpret mode (on CPU; see the module docstring)."""
    heads, b, t, n, r = q_latent.shape
    s, dr = k_rope.shape[1], k_rope.shape[2]
    dtype = latent.dtype
    if groups < 1 or heads % groups:
        raise ValueError(f"groups={groups} must divide the {heads} query heads")
    h = heads // groups
    if q_rope.shape != (b, t, heads, dr) or latent.shape != (b, s, n * groups, r) or k_rope.shape != (b, s, dr):
        raise ValueError(
            f"shapes do not match: q_latent {q_latent.shape}, q_rope {q_rope.shape}, latent {latent.shape}, "
            f"k_rope {k_rope.shape}"
        )
    if len({q_latent.dtype, q_rope.dtype, latent.dtype, k_rope.dtype}) != 1:
        raise ValueError("q_latent, q_rope, latent and k_rope must share one dtype")
    allowed = (jnp.bfloat16, jnp.float16, jnp.float32) if interpret else (jnp.bfloat16, jnp.float16)
    if dtype not in allowed:
        raise ValueError(f"the Mosaic GPU MLRA attention takes {', '.join(map(str, allowed))}; got {dtype}")
    if t != s or t % (COMPUTE_WGS * BLOCK_Q) or r % CHUNK or dr % CHUNK:
        raise ValueError(
            f"the kernel takes causal self-attention (T == S) over a multiple of {COMPUTE_WGS * BLOCK_Q} tokens, "
            f"latent and RoPE widths that are multiples of {CHUNK}; got T={t}, S={s}, R={r}, Dr={dr}"
        )
    if block_kv not in (64, 128) or t % block_kv:
        raise ValueError(f"block_kv={block_kv}: the kernel takes 64 or 128 keys per stage, dividing T={t}")
    per_cta, stages = plan(n, r, dr, branches, block_kv)
    if overlap is None:
        overlap = per_cta == 1
    if overlap and per_cta != 1:
        raise ValueError(f"overlap=True takes one branch per CTA; got branches={per_cta}")
    sets = n // per_cta  # the CTAs of one head and query tile: per_cta branches each
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    q_tiles = t // (COMPUTE_WGS * BLOCK_Q)
    scale_log2 = scale * LOG2E
    # Interpret mode ignores transforms; float32 (interpret only) has none.
    transforms = (
        (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128)) if jnp.dtype(dtype).itemsize == 2 else ()
    )

    def kernel(ql_ref, qr_ref, lat_ref, kr_ref, out_ref, lse_ref, scoped):
        (qr_smem, ql_smem, kr_smem, lat_smem, lse_smem), (q_barriers, kv_barriers, consumed, turn) = scoped
        head_group, bi = lax.axis_index("head_group"), lax.axis_index("batch")
        hi, first_block = head_group // sets, lax.rem(head_group, sets) * per_cta  # head, its first branch
        group = hi // h  # branch c of this head reads block c G + group
        q_tile = q_tiles - 1 - lax.axis_index("q_tile")  # the longest rows first
        wg = lax.axis_index("wg")
        max_steps = (q_tile + 1) * (COMPUTE_WGS * BLOCK_Q) // block_kv  # key tiles of the CTA's last rows

        def hand_over():
            """The ping-pong's turn (FA3, attention_mgpu's schedule barrier): both compute warpgroups arrive, then
            go on; called twice per branch and key tile by each, it lets one warpgroup's wgmma run while the
            other's softmax does."""
            if pingpong:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q0 = q_tile * (COMPUTE_WGS * BLOCK_Q) + wg * BLOCK_Q
            rows = pl.ds(q0, BLOCK_Q)
            for c in range(rope_chunks):
                plgpu.copy_gmem_to_smem(
                    qr_ref.at[bi, rows, hi, pl.ds(c * CHUNK, CHUNK)], qr_smem.at[wg, c], q_barriers.at[wg]
                )
            for j in range(per_cta):
                for c in range(lat_chunks):
                    plgpu.copy_gmem_to_smem(
                        ql_ref.at[hi, bi, rows, first_block + j, pl.ds(c * CHUNK, CHUNK)],
                        ql_smem.at[wg, j, c],
                        q_barriers.at[wg],
                    )
            plgpu.barrier_wait(q_barriers.at[wg])
            steps = (q0 + BLOCK_Q + block_kv - 1) // block_kv  # key tiles these rows read (at least one)
            unmasked = q0 // block_kv  # those wholly at or below every row's diagonal
            reduced = plgpu.Layout.WGMMA.reduce(1)
            m_i = tuple(
                _layout(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), reduced, interpret) for _ in range(per_cta)
            )
            l_i = tuple(_layout(jnp.full((BLOCK_Q,), 0, jnp.float32), reduced, interpret) for _ in range(per_cta))
            accs = tuple(
                tuple(
                    _layout(jnp.full((BLOCK_Q, CHUNK), 0, jnp.float32), plgpu.Layout.WGMMA, interpret)
                    for _ in range(lat_chunks)
                )
                for _ in range(per_cta)
            )
            plgpu.barrier_wait(kv_barriers.at[0])  # each later tile is awaited behind the previous one's P V
            pl.when(wg == 1)(hand_over)  # the first warpgroup goes first

            def kv_step(step, carry, masked):
                accs, m_i, l_i = carry
                slot = lax.rem(step, jnp.int32(stages))
                rope_tiles = lambda: [(qr_smem.at[wg, c], kr_smem.at[slot, c]) for c in range(rope_chunks)]  # noqa: E731
                # one branch: its scores [q_latent || q_rope] [latent || k_rope]^T in one accumulator (K = R + Dr);
                # several: the RoPE scores once, each branch's latent scores accumulated onto them
                rope = _scores(rope_tiles, None, interpret, block_kv) if per_cta > 1 else None
                if masked:
                    shape = (BLOCK_Q, block_kv)
                    keep = _rows(shape, interpret) + q0 >= _columns(shape, interpret) + step * block_kv
                new_accs, new_m, new_l = [], [], []
                for j in range(per_cta):

                    def tiles(j=j):
                        latent_tiles = [(ql_smem.at[wg, j, c], lat_smem.at[slot, j, c]) for c in range(lat_chunks)]
                        return latent_tiles if per_cta > 1 else rope_tiles() + latent_tiles

                    qk = _scores(tiles, rope, interpret, block_kv, issued=hand_over)
                    if masked:
                        qk = jnp.where(keep, qk, -jnp.inf)
                    # the running max in the scaled log2 domain: p = exp2(s * scale_log2 - m) is one FMA
                    m_new = jnp.maximum(m_i[j], qk.max(axis=1) * scale_log2)
                    alpha = jnp.exp2(m_i[j] - m_new)
                    p = jnp.exp2(qk * scale_log2 - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                    scaled = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs[j])
                    l_new = l_i[j] * alpha
                    p16 = p.astype(dtype)
                    if SUM_BEFORE_TURN:  # attention_mgpu's order for head widths up to 128
                        l_new = l_new + p.sum(axis=1)
                        scaled, l_new, m_new, p16 = lax.optimization_barrier((scaled, l_new, m_new, p16))
                        hand_over()
                    else:
                        hand_over()
                        l_new = l_new + p.sum(axis=1)

                    def next_tile(j=j):  # behind the last branch's P V: the next key tile's wait
                        if j == per_cta - 1:
                            following = step + 1
                            slot_after = lax.rem(following, jnp.int32(stages))
                            pl.when(following < steps)(lambda: plgpu.barrier_wait(kv_barriers.at[slot_after]))

                    values = lambda j=j: [lat_smem.at[slot, j, c] for c in range(lat_chunks)]  # noqa: E731
                    new_accs.append(_values(scaled, p16, values, interpret, issued=next_tile))
                    new_m.append(m_new)
                    new_l.append(l_new)
                # the slot is refilled only while tiles remain to load: every "consumed" phase is awaited
                pl.when(step + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[slot]))
                return tuple(new_accs), tuple(new_m), tuple(new_l)

            def keep_mask(step):
                shape = (BLOCK_Q, block_kv)
                return _rows(shape, interpret) + q0 >= _columns(shape, interpret) + step * block_kv

            def softmax(qk, m_prev, keep):
                if keep is not None:
                    qk = jnp.where(keep, qk, -jnp.inf)
                m_new = jnp.maximum(m_prev, qk.max(axis=1) * scale_log2)
                p = jnp.exp2(qk * scale_log2 - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                return p, m_new, jnp.exp2(m_prev - m_new)

            def key_tiles(slot):  # one branch: [q_latent || q_rope] against [latent || k_rope]
                rope_tiles = [(qr_smem.at[wg, c], kr_smem.at[slot, c]) for c in range(rope_chunks)]
                return rope_tiles + [(ql_smem.at[wg, 0, c], lat_smem.at[slot, 0, c]) for c in range(lat_chunks)]

            def overlapped(*o_refs):
                """One branch, FA3's intra-warpgroup overlap: key tile i's scores are issued together with tile
                i - 1's P V, whose wgmma runs on while tile i's softmax does. o_refs: the output accumulators
                (GPU); in interpret mode the output is carried as values, the same arithmetic in the same order."""
                qk = _scores(lambda: key_tiles(0), None, interpret, block_kv, issued=hand_over)
                p, m, _ = softmax(qk, m_i[0], keep_mask(0))  # every row's first tile: masked (all kept if below)
                hand_over()
                first = (p.astype(dtype), m, p.sum(axis=1), accs[0] if interpret else ())

                def step_fn(step, carry, masked):
                    p_prev, m, total, o = carry
                    slot, prev = lax.rem(step, jnp.int32(stages)), lax.rem(step - 1, jnp.int32(stages))
                    plgpu.barrier_wait(kv_barriers.at[slot])
                    values = lambda: [lat_smem.at[prev, 0, c] for c in range(lat_chunks)]  # noqa: E731
                    if interpret:
                        qk = _scores(lambda: key_tiles(slot), None, interpret, block_kv)
                        o = _values(o, p_prev, values, interpret)
                        hand_over()
                    else:

                        def scoped(s_ref):
                            for a, b in key_tiles(slot):
                                plgpu.wgmma(s_ref, a, plgpu.transpose_ref(b, (1, 0)))
                            for acc_ref, v in zip(o_refs, values()):
                                plgpu.wgmma(acc_ref, p_prev, v)
                            hand_over()
                            # the scores' groups are done; P V's (one per value chunk) may run on
                            return plgpu.wgmma_accumulator_load(s_ref, wait_n=lat_chunks)

                        qk = pl.run_scoped(scoped, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
                    p, m_new, alpha = softmax(qk, m, keep_mask(step) if masked else None)
                    hand_over()
                    total = total * alpha + p.sum(axis=1)
                    if interpret:
                        o = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in o)
                    else:
                        for acc_ref in o_refs:  # (reading waits for P V)
                            acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, acc_ref.shape, [0])
                    pl.when(step - 1 + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[prev]))
                    return p.astype(dtype), m_new, total, o

                split = jnp.maximum(unmasked, 1)
                carry = lax.fori_loop(1, split, functools.partial(step_fn, masked=False), first)
                p, m, total, o = lax.fori_loop(split, steps, functools.partial(step_fn, masked=True), carry)
                last = lax.rem(steps - 1, jnp.int32(stages))
                values = [lat_smem.at[last, 0, c] for c in range(lat_chunks)]
                if interpret:
                    o = _values(o, p, lambda: values, interpret)
                else:
                    for acc_ref, v in zip(o_refs, values):
                        plgpu.wgmma(acc_ref, p, v)
                    o = tuple(acc_ref[...] for acc_ref in o_refs)
                pl.when(steps - 1 + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[last]))
                return (o,), (m,), (total,)

            if overlap and interpret:
                accs, m_i, l_i = overlapped()
            elif overlap:
                accs, m_i, l_i = pl.run_scoped(overlapped, *[plgpu.ACC((BLOCK_Q, CHUNK), jnp.float32)] * lat_chunks)
            else:
                carry = (accs, m_i, l_i)
                carry = lax.fori_loop(0, unmasked, functools.partial(kv_step, masked=False), carry)
                accs, m_i, l_i = lax.fori_loop(unmasked, steps, functools.partial(kv_step, masked=True), carry)

            @pl.loop(steps, max_steps)
            def _skipped(step):  # the first warpgroup's tiles past its diagonal: observed, released, turns taken
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(kv_barriers.at[slot])
                pl.when(step + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[slot]))
                for _ in range(2 * per_cta):
                    hand_over()

            pl.when(wg == 0)(hand_over)  # the second warpgroup's last turn

            for j in range(per_cta):  # every row has its diagonal key: l > 0
                inverse = 1.0 / l_i[j]
                for c in range(lat_chunks):
                    out = accs[j][c] * lax.broadcast_in_dim(inverse, accs[j][c].shape, [0])
                    ql_smem.at[wg, j, c][...] = out.astype(dtype)
                lse_smem.at[wg, j][...] = (m_i[j] + jnp.log2(l_i[j])) * LN2
            plgpu.commit_smem()
            for j in range(per_cta):
                for c in range(lat_chunks):
                    plgpu.copy_smem_to_gmem(
                        ql_smem.at[wg, j, c], out_ref.at[hi, bi, rows, first_block + j, pl.ds(c * CHUNK, CHUNK)]
                    )
                plgpu.copy_smem_to_gmem(lse_smem.at[wg, j], lse_ref.at[bi, first_block + j, hi, rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(step, slot):
                keys = pl.ds(step * block_kv, block_kv)
                for c in range(rope_chunks):
                    plgpu.copy_gmem_to_smem(
                        kr_ref.at[bi, keys, pl.ds(c * CHUNK, CHUNK)], kr_smem.at[slot, c], kv_barriers.at[slot]
                    )
                for j in range(per_cta):
                    for c in range(lat_chunks):
                        plgpu.copy_gmem_to_smem(
                            lat_ref.at[bi, keys, (first_block + j) * groups + group, pl.ds(c * CHUNK, CHUNK)],
                            lat_smem.at[slot, j, c],
                            kv_barriers.at[slot],
                        )

            stream_tiles(fetch, consumed, stages, min(stages, s // block_kv), max_steps)  # (statically in bounds)

    def entry(*refs):
        smem = (
            plgpu.SMEM((COMPUTE_WGS, rope_chunks, BLOCK_Q, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, per_cta, lat_chunks, BLOCK_Q, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, rope_chunks, block_kv, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((stages, per_cta, lat_chunks, block_kv, CHUNK), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, per_cta, BLOCK_Q), jnp.float32),
        )
        copies = rope_chunks + per_cta * lat_chunks
        barriers = (
            plgpu.Barrier(num_arrivals=copies, num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=[
            jax.ShapeDtypeStruct((heads, b, t, n, r), dtype),
            jax.ShapeDtypeStruct((b, n, heads, t), jnp.float32),
        ],
        grid=(heads * sets, q_tiles, b),
        grid_names=("head_group", "q_tile", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
    )(q_latent, q_rope, latent, k_rope)
