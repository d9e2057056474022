"""Fused (flash) causal attention kernels and the choice among them.

Every variant's training and prefill attention reaches `choose` through
`core.attention`: q [B, T, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv]. The kernels
never write the [T, T] score matrix:

* cuDNN (NVIDIA): JAX's cuDNN flash attention module, forward and backward. On Hopper with
  cuDNN >= 9.10 it takes a key width above the value width (the latent family's 192 / 128)
  as it is; elsewhere the value is zero-padded to the key width (same result, more work).
  Under a mesh it runs per shard like splash: its own partitioning rule fails under FSDP
  meshes (seen with jax 0.11.2 on 2 x H200).
* splash (TPU): JAX's Pallas splash attention, vmapped over the batch and run per shard of
  the mesh's automatic axes (GSPMD cannot partition a kernel). Elsewhere it runs in Pallas
  interpret mode, which is how the tests check it on CPU.

`attention_impl="auto"` takes the first kernel that covers the call on this backend and
falls back to XLA with one logged line that names the reason; a kernel named by the user
that cannot take a call is an error (`KernelUnavailable`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlra_jax.platform import target_platform

log = logging.getLogger(__name__)

SPLASH_BLOCK = 512  # splash attention's q / kv tile (a divisor of the sequence; smaller tiles for short ones)
BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"
_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
# The open kernels_chosen() records, innermost last.
_RECORDS: contextvars.ContextVar[tuple[dict[str, int], ...]] = contextvars.ContextVar("kernels_chosen", default=())
# Primitives whose outputs hold a fused kernel's forward result and softmax statistics (remat policies keep them).
KERNEL_PRIMITIVES = frozenset(
    {
        "dot_product_attention_fwd_wrapper",
        "dot_product_attention_fwd",
        "dot_product_attention_fp8_fwd_wrapper",  # cuDNN's FP8 attention (fp8_attention)
        "pallas_call",
    }
)


class KernelUnavailable(ValueError):
    """The attention kernel the configuration names cannot run this call; the message says why."""


@functools.cache
def log_once(message: str) -> None:
    log.info(message)


# ----------------------------------------------------------------------------- cuDNN
def cudnn_module():
    """JAX's cuDNN attention module (private: the public jax.nn function wants equal q/k/v widths)."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def cudnn_problem(q: jax.Array, k: jax.Array, v: jax.Array) -> str | None:
    """Why cuDNN's flash attention cannot take this call, or None when it can."""
    if target_platform() != "gpu":
        return f"cuDNN needs an NVIDIA GPU (the JAX backend is {target_platform()!r})"
    if q.dtype not in _FUSED_DTYPES:
        return f"cuDNN flash attention takes bfloat16 or float16, not {q.dtype} (set model.compute_dtype=bfloat16)"
    if q.shape[1] != k.shape[1]:
        return f"cuDNN's causal mask here needs as many queries as keys ({q.shape[1]} vs {k.shape[1]})"
    try:
        module = cudnn_module()
        module.check_cudnn_version()
    except (ImportError, AttributeError, RuntimeError) as err:
        return f"JAX's cuDNN attention is unavailable ({err})"
    width = max(q.shape[-1], v.shape[-1])
    limit = 256 if module.check_compute_capability("9.0") else 128
    if width > limit or width % 8:
        return f"cuDNN takes head widths up to {limit} in multiples of 8, not {width}"
    if cudnn_native_widths(q.shape[-1], v.shape[-1]):  # JAX's own rules for this version (forward and training)
        try:
            module.check_is_flash_attention(
                q, k, v, module.AttentionLayout.BTNH.value, module.check_cudnn_version(), False, True
            )
        except NotImplementedError as err:
            return str(err)
        except TypeError:  # another JAX version's signature: its own checks run when the kernel is traced
            pass
    return None


def cudnn_native_widths(dk: int, dv: int) -> bool:
    """Whether cuDNN takes these widths as they are: equal, or a narrower value on Hopper with cuDNN >= 9.10."""
    if dk == dv:
        return True
    module = cudnn_module()
    return dk > dv and module.check_cudnn_version() >= 91000 and module.check_compute_capability("9.0")


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float) -> jax.Array:
    """Causal flash attention through cuDNN; unequal widths as they are where supported, else the narrower
    side zero-padded (which changes no dot product; the output is sliced back)."""
    module = cudnn_module()
    dv, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
    if not cudnn_native_widths(q.shape[-1], dv):
        q, k, v = (jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])]) for x in (q, k, v))
    run = lambda q, k, v: module.dot_product_attention(
        q, k, v, scale=scale, mask_type=module.MaskType.CAUSAL, qkv_layout="BTNH"
    )
    return per_shard(run, q, k, v)[..., :dv]


# ----------------------------------------------------------------------------- splash (TPU)
def splash_block(length: int) -> int | None:
    """The splash tile for a sequence: SPLASH_BLOCK or the largest power-of-two divisor >= 128 below it."""
    block = SPLASH_BLOCK
    while block >= 128:
        if length % block == 0:
            return block
        block //= 2
    return None


def splash_problem(q: jax.Array, k: jax.Array, v: jax.Array) -> str | None:
    if q.shape[1] != k.shape[1]:
        return f"splash's causal mask here needs as many queries as keys ({q.shape[1]} vs {k.shape[1]})"
    if splash_block(q.shape[1]) is None:
        return f"splash needs a sequence length that is a multiple of 128, not {q.shape[1]}"
    return None


def _splash_kernel(heads: int, length: int, is_mqa: bool, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    block = splash_block(length)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(heads)])
    make = splash.make_splash_mqa_single_device if is_mqa else splash.make_splash_mha_single_device
    return make(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float) -> jax.Array:
    """Causal splash attention (TPU; Pallas interpret mode on other backends)."""
    interpret = target_platform() != "tpu"
    if interpret:
        log_once("attention_impl='splash' runs in Pallas interpret mode: the JAX backend is not a TPU")

    def run(q, k, v):
        heads, kv_heads = q.shape[2], k.shape[2]
        kernel = _splash_kernel(heads, q.shape[1], kv_heads == 1, interpret)
        to_heads = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, D] -> [B, H, T, D]
        qh, kh, vh = to_heads(q * jnp.asarray(scale, q.dtype)), to_heads(k), to_heads(v)
        if kv_heads == 1:
            kh, vh = kh[:, 0], vh[:, 0]
        return to_heads(jax.vmap(kernel)(qh, kh, vh))

    return per_shard(run, q, k, v)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a kernel call splits over the mesh's automatic axes (per_shard): one shard_map over all of them."""

    axes: frozenset[str]  # the shard_map's axes: every automatic axis of the mesh
    q: P  # q and the output [B, T, H, D]
    kv: P  # k and v [B, S, H_kv, D]
    stats: P  # per-query-head statistics [B, H, T]
    # the axes over which each device's k / v gradient is a part of the sum (query heads split, one KV head kept)
    kv_partial: tuple[str, ...]


def shard_plan(q: jax.Array, k: jax.Array) -> ShardPlan | None:
    """per_shard's split of a call with these q, k under the current mesh; None without a mesh or automatic
    axes. The batch splits over the data axes and the heads over `tensor` where they divide; other axes
    compute redundantly."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    auto = {
        name: size
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
        if kind != jax.sharding.AxisType.Manual
    }
    if not auto:
        return None
    batch = tuple(a for a in BATCH_AXES if auto.get(a, 1) > 1)
    if batch and q.shape[0] % math.prod(auto[a] for a in batch):
        batch = ()
    tensor = auto.get(HEAD_AXIS, 1)
    heads = tensor > 1 and q.shape[2] % tensor == 0 and (k.shape[2] % tensor == 0 or k.shape[2] == 1)
    kv_heads = heads and k.shape[2] > 1
    return ShardPlan(
        axes=frozenset(auto),
        q=P(batch or None, None, HEAD_AXIS if heads else None, None),
        kv=P(batch or None, None, HEAD_AXIS if kv_heads else None, None),
        stats=P(batch or None, HEAD_AXIS if heads else None, None),
        kv_partial=(HEAD_AXIS,) if heads and not kv_heads else (),
    )


def per_shard(fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """fn on each device's shard under a mesh: one shard_map over every axis still automatic here (shard_plan),
    so neither GSPMD nor a kernel's own partitioning rule (cuDNN's) ever sees the kernel."""
    plan = shard_plan(q, k)
    if plan is None:
        return fn(q, k, v)
    return jax.shard_map(
        fn, in_specs=(plan.q, plan.kv, plan.kv), out_specs=plan.q, axis_names=set(plan.axes), check_vma=False
    )(q, k, v)


# ----------------------------------------------------------------------------- the choice
KERNELS: dict[str, tuple[Callable[..., str | None], Callable[..., jax.Array]]] = {
    "cudnn": (cudnn_problem, cudnn_attention),
    "splash": (splash_problem, splash_attention),
}
AUTO_ORDER = {"gpu": ("cudnn",), "tpu": ("splash",)}


def choose(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, masked: bool) -> Callable[..., jax.Array] | None:
    """The fused kernel for this call, or None for XLA. `impl`: auto, xla or a kernel's name."""
    if impl == "xla":
        return None
    if impl == "auto":
        if masked:
            log_once("attention_impl='auto': attention under an explicit mask (padded or cached sequences) runs on XLA")
            return None
        for name in AUTO_ORDER.get(target_platform(), ()):
            problem = KERNELS[name][0](q, k, v)
            if problem is None:
                _record(name, q, v)
                return KERNELS[name][1]
            log_once(
                f"attention_impl='auto': {name} cannot run q {q.shape} k {k.shape} v {v.shape} "
                f"{q.dtype}: {problem}; falling back to XLA"
            )
        _record("xla", q, v)
        return None
    if impl not in KERNELS:
        raise KernelUnavailable(
            f"attention_impl={impl!r} is not a fused attention kernel; allowed: auto, xla, {', '.join(KERNELS)}"
        )
    if masked:
        raise KernelUnavailable(
            f"attention_impl={impl!r} supports the plain causal mask only; padded or cached "
            f"attention needs attention_impl='auto' or 'xla'"
        )
    problem = KERNELS[impl][0](q, k, v)
    if problem is not None:
        raise KernelUnavailable(
            f"attention_impl={impl!r} cannot run q {q.shape} k {k.shape} v {v.shape} "
            f"{q.dtype}: {problem}; use attention_impl='auto' or 'xla'"
        )
    _record(impl, q, v)
    return KERNELS[impl][1]


@contextlib.contextmanager
def kernels_chosen() -> Iterator[dict[str, int]]:
    """Inside: the attention kernels chosen by what is traced here, by name -> calls traced, in the dict yielded
    (the benchmarks and the TPU compile report them)."""
    chosen: dict[str, int] = {}
    token = _RECORDS.set((*_RECORDS.get(), chosen))
    try:
        yield chosen
    finally:
        _RECORDS.reset(token)


def _record(name: str, q: jax.Array, v: jax.Array) -> None:
    if name == "cudnn" and q.shape[-1] != v.shape[-1]:
        name = "cudnn" if cudnn_native_widths(q.shape[-1], v.shape[-1]) else "cudnn (v padded)"
    log.debug("attention kernel %s for q %s, v %s", name, q.shape, v.shape)
    record(name)


def record(name: str) -> None:
    """Count one traced call of the attention kernel `name` in the open kernels_chosen() records."""
    for chosen in _RECORDS.get():
        chosen[name] = chosen.get(name, 0) + 1
