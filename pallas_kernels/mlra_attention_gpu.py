"""MLRA's causal training attention, forward, as a Pallas Mosaic GPU kernel for Hopper (H100/H200).

The absorbed layout (mlra_jax.attention.latent, `absorbed_attention` / `latent_heads_attention`): n latent blocks
(branches), each one KV head of key [latent_j || k_rope] (R + Dr wide) and value latent_j (R), serving H query
heads [q_latent_j || q_rope]. The RoPE key k_rope and the query's RoPE part q_rope are the same for every branch
(MLRA-4: 4 blocks, 4 branches, one head group), so for each (query tile, key tile) the RoPE scores q_r . k_r are
computed once and every branch's latent scores are added to them:

    s_j = (q_rope k_rope^T) + q_latent_j latent_j^T,   out_j = softmax(scale * s_j, causal) latent_j.

Shapes: q_latent [B, T, n, H, R], q_rope [B, T, H, Dr], latent [B, S, n, R], k_rope [B, S, Dr] -> out
[B, T, n, H, R] and the natural-log logsumexp of the scaled logits [B, n, H, T] (float32, for the backward).
Causal with T == S (training).

Design (FlashAttention-3's forward, jax.experimental.pallas.ops.gpu.attention_mgpu, with MLRA's sharing):
  * A CTA takes one (head, group of `branches` latent blocks, 128 queries, sequence): two compute warpgroups of
    64 query rows each (wgmma's M) and one memory warpgroup.
  * Each compute warpgroup loads its q_rope tile and its branches' q_latent tiles by TMA once. The memory
    warpgroup streams tiles of `block_kv` keys (64 or 128) by TMA through `stages` SMEM slots: the k_rope tile
    once and each branch's latent tile (which is its key and its value: read once, used twice), with a barrier
    per slot for "loaded" and one for "consumed" (both compute warpgroups arrive).
  * Per key tile a compute warpgroup runs the RoPE scores q_r k_r^T once (wgmma, K = Dr) and then, per branch,
    accumulates that branch's latent scores onto them (wgmma initialized with the RoPE scores, K = R), an online
    softmax in the log2 domain with the branch's own running max and sum, and P latent_j (wgmma, P from
    registers). The RoPE product is 1/`branches` of what n separate attentions would spend on it.
  * Causal tile skipping: a warpgroup's rows [q0, q0 + 64) read the key tiles up to the one holding key q0 + 63;
    the tiles below the diagonal run unmasked, the last one masked. The memory warpgroup loads the tiles of the
    CTA's last rows; the first warpgroup waits on (and releases) the tiles it skips after storing its output, so
    that every barrier phase is observed in order.
  * `branches` (plan): the most branches whose accumulators fit 256 float32 columns per warpgroup (128
    registers a thread, FA3's head-dim-256 budget): 2 at R = 128 (MLRA-4 2.9B: the RoPE product shared by 2
    branches, half its FLOPs saved), 4 at R = 64. SMEM: at R = 128, Dr = 64, 2 branches: 80 KiB of queries and
    3 stages of 40 KiB.
  * Output: each warpgroup normalizes, writes its rows into its query SMEM (no longer read) and copies them out
    by TMA; the logsumexp likewise.

On an H100 (jax 0.11; `mlra bench attention_kernels --kernels=mlra`, experiments/results/
attention_kernels_mlra_h100.json) it matches its reference and cuDNN at the 2.9B MLRA-4 and MLRA-2 layers. There the
2-branch plan spills registers (316-364 bytes a thread at R = 128, 64-key tiles) and runs slower than one branch
per CTA; the fastest tiling measured is `branches=1, block_kv=128` (no spill), about as fast as cuDNN's forward.
The accumulators' scopes index their SMEM tiles inside the scope (`_scores`, `_values`): under jax 0.11 a view
made outside and closed over by `pl.run_state` fails to lower.

Interpret mode (Pallas's Mosaic GPU interpreter on CPU, `interpret=True`; jax 0.10): it runs this kernel's
threads, barriers, TMA copies between GMEM and SMEM, SMEM reads and writes, the pipeline's slots and phases,
causal tile skipping and masking, the softmax and the stores, and it checks that every barrier phase is
observed (it raises on a skipped phase). It cannot run four Hopper-only pieces, which `interpret=True` replaces
by the same arithmetic on the same SMEM data:
  1. wgmma with a transposed B operand (`plgpu.transpose_ref`: the interpreter's wgmma reads B untransposed);
  2. wgmma with the A operand in registers (P in P latent_j);
  3. `pl.run_state` over a wgmma accumulator (accumulating onto the RoPE scores and the running output);
  4. register layouts (`plgpu.layout_cast`, `plgpu.broadcasted_iota(layout=...)`: no CPU lowering).
In interpret mode the products are float32 jnp.dot of the operands read from SMEM (`_scores`, `_values`), the
layouts plain arrays; those four, the register budget, the 128-byte swizzle of bf16 tiles (the interpreter
ignores transforms) and the speed are checked on the GPU only (the benchmark's rows carry their errors). Float32
inputs run only in interpret mode (the tests' exact comparison); the GPU takes bf16 or f16.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64  # columns per SMEM tile (the 128-byte swizzle of bf16) and per value accumulator
BLOCK_Q = 64  # query rows per compute warpgroup (wgmma's M)
BLOCK_KV = 64  # keys per pipeline stage (the default; 128 also fits the CTA's 128 query rows)
COMPUTE_WGS = 2
SMEM_BYTES = 220 * 1024
MAX_ACC_COLUMNS = 256  # float32 accumulator columns per warpgroup: 128 registers a thread
MAX_STAGES = 4
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def mlra_attention_reference(
    q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, *, scale: float
) -> tuple[jax.Array, jax.Array]:
    """The kernel's definition in plain jnp: causal attention of [q_latent_j || q_rope] over keys
    [latent_j || k_rope] and values latent_j per block j, float32 logits and softmax; (out [B, T, n, H, R] in the
    inputs' dtype, logsumexp [B, n, H, T] float32 of the scaled logits)."""
    f32 = jnp.float32
    logits = jnp.einsum("btnhr,bsnr->bnhts", q_latent.astype(f32), latent.astype(f32))
    logits = logits + jnp.einsum("bthd,bsd->bhts", q_rope.astype(f32), k_rope.astype(f32))[:, None]
    logits = logits * scale
    t, s = logits.shape[-2:]
    causal = jnp.arange(t)[:, None] >= jnp.arange(s)[None, :]
    logits = jnp.where(causal, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    out = jnp.einsum("bnhts,bsnr->btnhr", probs, latent.astype(f32))
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


def _gpu_interpret_params():
    """Pallas's GPU interpret mode (exported as plgpu.InterpretGPUParams in later jax versions)."""
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


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


def _scores(pairs: Callable[[], list], init: jax.Array | None, interpret: bool, block_kv: int) -> jax.Array:
    """init (or zeros) + sum of a b^T over the pairs() of SMEM tiles a [64, CHUNK] (queries), b [block_kv, CHUNK]
    (keys): wgmma with b transposed on the GPU; float32 products of the SMEM contents in interpret mode. The tiles
    are indexed inside the accumulator's scope (`pairs` is called there): a view made outside and closed over
    brings its static indices into `pl.run_state` as operands, which Mosaic GPU (jax 0.11) cannot pass through."""
    if interpret:
        total = init
        for a, b in pairs():
            product = lax.dot_general(
                a[...], b[...], (((1,), (1,)), ((), ())), precision="highest", preferred_element_type=jnp.float32
            )
            total = product if total is None else total + product
        return total

    def body(acc_ref):
        for a, b in pairs():
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b, (1, 0)))

    if init is None:

        def scoped(acc_ref):
            body(acc_ref)
            return acc_ref[...]

        return pl.run_scoped(scoped, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
    return pl.run_state(body)(plgpu.ACC.init(init))


def _values(
    accs: tuple[jax.Array, ...], p: jax.Array, values: Callable[[], list], interpret: bool
) -> tuple[jax.Array, ...]:
    """accs[c] + p values()[c] for the value chunks values()[c] [block_kv, CHUNK] in SMEM (indexed inside the
    accumulators' scope, as in `_scores`), p [64, block_kv] in registers: wgmma with A from registers on the
    GPU."""
    if interpret:
        return tuple(
            acc + jnp.dot(p, v[...], precision="highest", preferred_element_type=jnp.float32)
            for acc, v in zip(accs, values())
        )

    def body(acc_refs):
        for acc_ref, v in zip(acc_refs, values()):
            plgpu.wgmma(acc_ref, p, v)

    return pl.run_state(body)(tuple(plgpu.ACC.init(a) for a in accs))


@functools.partial(jax.jit, static_argnames=("scale", "branches", "block_kv", "interpret"))
def mlra_attention_gpu(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    *,
    scale: float,
    branches: int | None = None,
    block_kv: int = BLOCK_KV,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Causal MLRA attention forward: q_latent [B, T, n, H, R], q_rope [B, T, H, Dr] (every block's), latent
    [B, S, n, R], k_rope [B, S, Dr] -> (out [B, T, n, H, R], logsumexp [B, n, H, T] float32), as
    mlra_attention_reference. branches: latent blocks per CTA sharing the RoPE scores (default: `plan`); block_kv:
    keys per pipeline stage, 64 or 128.
    interpret=True runs it in Pallas's GPU interpret mode (on CPU; see the module docstring)."""
    b, t, n, h, r = q_latent.shape
    s, dr = k_rope.shape[1], k_rope.shape[2]
    dtype = latent.dtype
    if q_rope.shape != (b, t, h, dr) or latent.shape != (b, s, n, r) or k_rope.shape != (b, s, dr):
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
    groups = n // per_cta
    rope_chunks, lat_chunks = dr // CHUNK, r // CHUNK
    q_tiles = t // (COMPUTE_WGS * BLOCK_Q)
    scale_log2 = scale * LOG2E
    # Interpret mode ignores transforms; float32 (interpret only) has none.
    transforms = (
        (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128)) if jnp.dtype(dtype).itemsize == 2 else ()
    )

    def kernel(ql_ref, qr_ref, lat_ref, kr_ref, out_ref, lse_ref, scoped):
        (qr_smem, ql_smem, kr_smem, lat_smem, lse_smem), (q_barriers, kv_barriers, consumed) = scoped
        head_group, bi = lax.axis_index("head_group"), lax.axis_index("batch")
        hi, first_block = head_group // groups, lax.rem(head_group, groups) * per_cta
        q_tile = q_tiles - 1 - lax.axis_index("q_tile")  # the longest rows first
        wg = lax.axis_index("wg")
        max_steps = (q_tile + 1) * (COMPUTE_WGS * BLOCK_Q) // block_kv  # key tiles of the CTA's last rows

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
                        ql_ref.at[bi, rows, first_block + j, hi, pl.ds(c * CHUNK, CHUNK)],
                        ql_smem.at[wg, j, c],
                        q_barriers.at[wg],
                    )
            plgpu.barrier_wait(q_barriers.at[wg])
            steps = (q0 + BLOCK_Q + block_kv - 1) // block_kv  # key tiles these rows read
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

            def kv_step(step, carry, masked):
                accs, m_i, l_i = carry
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(kv_barriers.at[slot])
                # the RoPE scores, once for all of this CTA's branches
                rope_tiles = lambda: [(qr_smem.at[wg, c], kr_smem.at[slot, c]) for c in range(rope_chunks)]  # noqa: E731
                rope = _scores(rope_tiles, None, interpret, block_kv)
                if masked:
                    shape = (BLOCK_Q, block_kv)
                    keep = _rows(shape, interpret) + q0 >= _columns(shape, interpret) + step * block_kv
                new_accs, new_m, new_l = [], [], []
                for j in range(per_cta):
                    tiles = lambda j=j: [(ql_smem.at[wg, j, c], lat_smem.at[slot, j, c]) for c in range(lat_chunks)]  # noqa: E731
                    qk = _scores(tiles, rope, interpret, block_kv)
                    qk = qk * scale_log2
                    if masked:
                        qk = jnp.where(keep, qk, -jnp.inf)
                    m_new = jnp.maximum(m_i[j], qk.max(axis=1))
                    alpha = jnp.exp2(m_i[j] - m_new)
                    p = jnp.exp2(qk - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                    new_l.append(l_i[j] * alpha + p.sum(axis=1))
                    scaled = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs[j])
                    values = lambda j=j: [lat_smem.at[slot, j, c] for c in range(lat_chunks)]  # noqa: E731
                    new_accs.append(_values(scaled, p.astype(dtype), values, interpret))
                    new_m.append(m_new)
                # the slot is refilled only while tiles remain to load: every "consumed" phase is awaited
                pl.when(step + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[slot]))
                return tuple(new_accs), tuple(new_m), tuple(new_l)

            carry = (accs, m_i, l_i)
            carry = lax.fori_loop(0, unmasked, functools.partial(kv_step, masked=False), carry)
            accs, m_i, l_i = lax.fori_loop(unmasked, steps, functools.partial(kv_step, masked=True), carry)

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
                        ql_smem.at[wg, j, c], out_ref.at[bi, rows, first_block + j, hi, pl.ds(c * CHUNK, CHUNK)]
                    )
                plgpu.copy_smem_to_gmem(lse_smem.at[wg, j], lse_ref.at[bi, first_block + j, hi, rows])

            @pl.loop(steps, max_steps)
            def _skipped(step):  # the first warpgroup's tiles past its diagonal: observed and released
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(kv_barriers.at[slot])
                pl.when(step + stages < max_steps)(lambda: plgpu.barrier_arrive(consumed.at[slot]))

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
                            lat_ref.at[bi, keys, first_block + j, pl.ds(c * CHUNK, CHUNK)],
                            lat_smem.at[slot, j, c],
                            kv_barriers.at[slot],
                        )

            for i in range(min(stages, s // block_kv)):  # (statically in bounds)
                pl.when(i < max_steps)(functools.partial(fetch, i, i))

            @pl.loop(0, jnp.maximum(max_steps - stages, 0))
            def _refill(step):
                slot = lax.rem(step, jnp.int32(stages))
                plgpu.barrier_wait(consumed.at[slot])
                fetch(step + stages, slot)

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
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, barriers, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=[
            jax.ShapeDtypeStruct((b, t, n, h, r), dtype),
            jax.ShapeDtypeStruct((b, n, h, t), jnp.float32),
        ],
        grid=(h * groups, q_tiles, b),
        grid_names=("head_group", "q_tile", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
        interpret=_gpu_interpret_params() if interpret else None,
    )(q_latent, q_rope, latent, k_rope)
