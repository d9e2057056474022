"""A one-shot all-reduce of small bf16 arrays among the GPUs of one host, as a PTX kernel that reads its peers'
partials over NVLink (NVIDIA Hopper; launched through jaxlib's Triton kernel call, which takes PTX).

Why: a tensor-parallel decode step all-reduces its [batch, d] hidden state twice per layer, and NCCL takes 15-20 us
for each whatever its size (49 per step of the 24-layer models, about 0.9 ms). Here each all-reduce is one kernel:

* every device owns an *exchange* buffer (mlra_jax.peer_exchange allocates it and maps the peers' into each
  process): two data slots of SLOT_BYTES, per-CTA flags and per-CTA call counters (`ExchangeLayout`);
* CTA c owns the 16-byte vectors [c V, (c + 1) V) of the array (V = VECTORS_PER_CTA, whatever the array's size):
  it copies them from the input into its slot, raises its flag in every peer's exchange (a release store at
  system scope), waits until every peer's flag for CTA c shows this call (acquire loads), reads the vectors from
  every device's slot in rank order, sums them in float32 and writes the bf16 result;
* each CTA counts its calls in its own exchange: the count is the flag's value and its parity picks the slot, so
  that a peer still reading this CTA's vectors of call k is never overwritten before it has joined call k + 1;
* every device sums the same values in the same order: the result is identical on every device, and equal to the
  float32 sum rounded once to bf16 (`reference`).

The kernel's inputs are the local partial x and the device's *table* (uint32 pairs of 64-bit words: its rank in
the group, the group's size, then every member's exchange address as this process sees it); its output is the sum.
A wait that outlasts TIMEOUT_NS (a peer that never joins) traps, so that a broken group fails instead of hanging.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

THREADS = 512  # per CTA
VECTORS_PER_THREAD = 2  # 16-byte vectors, loaded together
VECTORS_PER_CTA = THREADS * VECTORS_PER_THREAD
MAX_CTAS = 128
MAX_RANKS = 8
SLOT_BYTES = MAX_CTAS * VECTORS_PER_CTA * 16  # 2 MiB: the largest array one call reduces
TIMEOUT_NS = 20_000_000_000
DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class ExchangeLayout:
    """Byte offsets in a device's exchange buffer: two data slots, flags [2, MAX_RANKS, MAX_CTAS] and counters
    [MAX_CTAS] (uint32), zeroed at allocation."""

    flags: int = 2 * SLOT_BYTES
    counters: int = 2 * SLOT_BYTES + 2 * MAX_RANKS * MAX_CTAS * 4

    @property
    def size(self) -> int:
        return self.counters + MAX_CTAS * 4


LAYOUT = ExchangeLayout()


def fits(shape: tuple[int, ...], dtype: jnp.dtype, ranks: int) -> bool:
    """Whether one kernel call reduces an array of this shape and dtype over `ranks` devices."""
    size = int(np.prod(shape))
    return jnp.dtype(dtype) == DTYPE and 2 <= ranks <= MAX_RANKS and size % 8 == 0 and 0 < size * 2 <= SLOT_BYTES


def ctas_for(size: int) -> int:
    """CTAs of a call over `size` bf16 elements: one per VECTORS_PER_CTA vectors of 8."""
    return -(-(size // 8) // VECTORS_PER_CTA)


def table_row(rank: int, addresses: list[int]) -> np.ndarray:
    """A device's table: [rank, ranks, address of each member's exchange...] as uint32 pairs (little-endian words)."""
    return np.array([rank, len(addresses), *addresses], np.uint64).view(np.uint32)


def reference(partials: jax.Array) -> jax.Array:
    """What every device gets from partials [ranks, ...] (bf16): their float32 sum in rank order, rounded once."""
    total = partials[0].astype(jnp.float32)
    for r in range(1, partials.shape[0]):
        total = total + partials[r].astype(jnp.float32)
    return total.astype(partials.dtype)


def ptx_source(name: str, vectors: int, ranks: int) -> str:
    """The kernel in PTX for `vectors` 16-byte vectors (8 bf16 each) over `ranks` devices."""
    lay = LAYOUT
    lines: list[str] = []
    emit = lines.append
    emit(".version 8.0\n.target sm_90\n.address_size 64\n")
    emit(f".visible .entry {name}(\n  .param .u64 p_x,\n  .param .u64 p_table,\n  .param .u64 p_out\n)")
    emit(f".maxntid {THREADS}, 1, 1\n{{")
    emit("  .reg .pred %p<16>;\n  .reg .b32 %r<160>;\n  .reg .b64 %rd<64>;\n  .reg .f32 %f<40>;")
    emit("  .shared .align 4 .b32 s_gen;")
    emit("  ld.param.u64 %rd1, [p_x];\n  ld.param.u64 %rd2, [p_table];\n  ld.param.u64 %rd3, [p_out];")
    emit("  cvta.to.global.u64 %rd1, %rd1;\n  cvta.to.global.u64 %rd2, %rd2;\n  cvta.to.global.u64 %rd3, %rd3;")
    emit("  mov.u32 %r1, %tid.x;\n  mov.u32 %r2, %ctaid.x;")
    # rank, this device's exchange (%rd6) and every member's (%rd10 + r)
    emit("  ld.global.u64 %rd4, [%rd2];\n  cvt.u32.u64 %r3, %rd4;")
    emit("  mul.wide.u32 %rd5, %r3, 8;\n  add.u64 %rd5, %rd5, %rd2;\n  ld.global.u64 %rd6, [%rd5+16];")
    for r in range(ranks):
        emit(f"  ld.global.u64 %rd{10 + r}, [%rd2+{16 + 8 * r}];")
    # this call's count (thread 0), its slot's offset
    emit("  setp.ne.u32 %p1, %r1, 0;\n  mul.wide.u32 %rd7, %r2, 4;\n  add.u64 %rd7, %rd7, %rd6;\n  @%p1 bra GEN_DONE;")
    emit(f"  ld.global.u32 %r4, [%rd7+{lay.counters}];\n  add.u32 %r4, %r4, 1;\n  st.shared.u32 [s_gen], %r4;")
    emit("GEN_DONE:\n  bar.sync 0;\n  ld.shared.u32 %r5, [s_gen];\n  and.b32 %r6, %r5, 1;")
    emit(f"  mul.wide.u32 %rd8, %r6, {SLOT_BYTES};")
    emit(f"  mad.lo.u32 %r7, %r2, {VECTORS_PER_CTA}, %r1;")
    # copy this CTA's vectors of x into the slot
    for k in range(VECTORS_PER_THREAD):
        emit(f"  add.u32 %r8, %r7, {k * THREADS};\n  setp.ge.u32 %p2, %r8, {vectors};\n  @%p2 bra COPY_{k};")
        emit("  mul.wide.u32 %rd9, %r8, 16;\n  add.u64 %rd20, %rd1, %rd9;")
        emit("  ld.global.nc.v4.u32 {%r10, %r11, %r12, %r13}, [%rd20];")
        emit("  add.u64 %rd21, %rd6, %rd8;\n  add.u64 %rd21, %rd21, %rd9;")
        emit(f"  st.global.v4.u32 [%rd21], {{%r10, %r11, %r12, %r13}};\nCOPY_{k}:")
    emit("  bar.sync 0;")
    # thread t < ranks, t != rank: raise this CTA's flag in peer t's exchange, wait for peer t's in ours
    emit(f"  setp.ge.u32 %p3, %r1, {ranks};\n  setp.eq.u32 %p4, %r1, %r3;")
    emit("  or.pred %p3, %p3, %p4;\n  @%p3 bra SYNC_DONE;")
    emit("  mul.wide.u32 %rd22, %r1, 8;\n  add.u64 %rd22, %rd22, %rd2;\n  ld.global.u64 %rd23, [%rd22+16];")
    emit(f"  mad.lo.u32 %r20, %r6, {MAX_RANKS * MAX_CTAS}, %r2;\n  mad.lo.u32 %r21, %r3, {MAX_CTAS}, %r20;")
    emit("  mul.wide.u32 %rd24, %r21, 4;\n  add.u64 %rd24, %rd24, %rd23;")
    emit(f"  st.release.sys.global.u32 [%rd24+{lay.flags}], %r5;")
    emit(f"  mad.lo.u32 %r22, %r1, {MAX_CTAS}, %r20;\n  mul.wide.u32 %rd25, %r22, 4;\n  add.u64 %rd25, %rd25, %rd6;")
    emit("  mov.u64 %rd30, %globaltimer;\nSPIN:")
    emit(f"  ld.acquire.sys.global.u32 %r23, [%rd25+{lay.flags}];")
    emit("  setp.eq.u32 %p5, %r23, %r5;\n  @%p5 bra SYNC_DONE;")
    emit(f"  mov.u64 %rd31, %globaltimer;\n  sub.u64 %rd31, %rd31, %rd30;\n  setp.gt.u64 %p6, %rd31, {TIMEOUT_NS};")
    emit("  @%p6 trap;\n  bra SPIN;\nSYNC_DONE:\n  bar.sync 0;")
    # sum every member's vectors in rank order (float32), store bf16
    for k in range(VECTORS_PER_THREAD):
        emit(f"  add.u32 %r8, %r7, {k * THREADS};\n  setp.ge.u32 %p2, %r8, {vectors};\n  @%p2 bra SUM_{k};")
        emit("  mul.wide.u32 %rd9, %r8, 16;\n  add.u64 %rd26, %rd8, %rd9;")
        for r in range(ranks):
            base = 30 + 4 * r
            emit(f"  add.u64 %rd27, %rd{10 + r}, %rd26;")
            emit(f"  ld.global.cg.v4.u32 {{%r{base}, %r{base + 1}, %r{base + 2}, %r{base + 3}}}, [%rd27];")
        for r in range(ranks):
            for w in range(4):
                word, bits = 30 + 4 * r + w, 70 + 8 * r + 2 * w
                lo, hi = (2 * w, 2 * w + 1) if r == 0 else (16 + 2 * w, 17 + 2 * w)
                emit(f"  shl.b32 %r{bits}, %r{word}, 16;\n  mov.b32 %f{lo}, %r{bits};")
                emit(f"  and.b32 %r{bits + 1}, %r{word}, -65536;\n  mov.b32 %f{hi}, %r{bits + 1};")
            if r:
                for i in range(8):
                    emit(f"  add.rn.f32 %f{i}, %f{i}, %f{16 + i};")
        for w in range(4):
            emit(f"  cvt.rn.bf16x2.f32 %r{140 + w}, %f{2 * w + 1}, %f{2 * w};")
        emit("  add.u64 %rd28, %rd3, %rd9;\n  st.global.v4.u32 [%rd28], {%r140, %r141, %r142, %r143};")
        emit(f"SUM_{k}:")
    emit("  @%p1 bra END;")
    emit(f"  st.global.u32 [%rd7+{lay.counters}], %r5;\nEND:\n  ret;\n}}\n")
    return "\n".join(lines)


_primitive = None


def _lowering(ctx, x, table):
    """The kernel as jaxlib's Triton kernel call (an FFI custom call that XLA's command buffers capture)."""
    from jax._src.interpreters import mlir
    from jax._src.lib import gpu_triton
    from jax._src.lib.mlir import ir

    aval, out = ctx.avals_in[0], ctx.avals_out[0]
    size, ranks = int(np.prod(aval.shape)), ctx.avals_in[1].shape[-1] // 2 - 2
    name = f"peer_all_reduce_r{ranks}_v{size // 8}"
    capability = gpu_triton.get_compute_capability(0)  # ptxas compiles the sm_90 PTX for this GPU
    kernel = gpu_triton.TritonKernel(name, THREADS // 32, 1, 0, ptx_source(name, size // 8, ranks), "", capability)
    call = gpu_triton.TritonKernelCall(kernel, ctas_for(size), 1, 1, [gpu_triton.create_array_parameter(0, 16)] * 3)
    try:
        result_type = mlir.aval_to_ir_type(ctx.module_context, out)
    except TypeError:  # jax 0.10 takes the aval alone
        result_type = mlir.aval_to_ir_type(out)
    layouts = [list(reversed(range(len(a.shape)))) for a in (*ctx.avals_in, out)]
    opaque = zlib.compress(call.to_proto(name, b""))
    return mlir.custom_call(
        "triton_kernel_call_ffi",
        result_types=[result_type],
        operands=[x, table],
        backend_config=dict(name=ir.StringAttr.get(name), opaque=ir.StringAttr.get(opaque)),
        operand_layouts=layouts[:2],
        result_layouts=layouts[2:],
    ).results


def _make_primitive():
    from jax._src.interpreters import mlir
    from jax.extend.core import Primitive

    primitive = Primitive("peer_all_reduce")
    primitive.def_abstract_eval(lambda x, table: x.update(weak_type=False))  # shape, dtype and shard_map's vma
    primitive.def_impl(lambda x, table: jax.jit(primitive.bind)(x, table))
    mlir.register_lowering(primitive, _lowering, platform="cuda")
    return primitive


def peer_all_reduce(x: jax.Array, table: jax.Array) -> jax.Array:
    """The sum of x over the devices of the exchange group that `table` (this device's table_row, uint32) names.
    Every member calls it in the same order with the same shape (`fits`); NVIDIA GPUs only."""
    global _primitive
    if _primitive is None:
        _primitive = _make_primitive()
    ranks = table.shape[-1] // 2 - 2
    if not fits(x.shape, x.dtype, ranks):
        raise ValueError(
            f"peer_all_reduce takes bf16 arrays of at most {SLOT_BYTES} bytes, in 8s; got {x.shape} {x.dtype}"
        )
    return _primitive.bind(x, table)


@functools.cache
def available() -> bool:
    """Whether this jaxlib can launch the kernel: its CUDA plugin's Triton kernel call, with the constructor this
    module calls (jax 0.11's)."""
    try:
        from jax._src.lib import gpu_triton

        kernel = gpu_triton.TritonKernel("probe", 1, 1, 0, "", "", 90)
        gpu_triton.TritonKernelCall(kernel, 1, 1, 1, [gpu_triton.create_array_parameter(0, 16)]).to_proto("probe", b"")
    except (ImportError, AttributeError, TypeError):
        return False
    return True
