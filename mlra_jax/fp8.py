"""FP8 training matmuls (`model.matmul_dtype=float8`): the projections' products on FP8 tensor cores.

Each product x [M, K] @ W [K, N] runs as cuBLASLt FP8 GEMMs with per-tensor scales: the forward multiplies
e4m3 activations by e4m3 weights, the backward multiplies the e5m2 output gradient by each. Every GEMM is
written with both operands contracting over their last axis, the one layout in which Hopper's FP8 GEMMs run at
full rate; the transposed copies it needs are made with the straight ones, in one pass over each operand: for
activations and gradients by the FP8 cast kernel where it runs (`model.fp8_casts`, mlra_jax.fp8_casts), else and for
weights by XLA's quantizing fusions. Products accumulate in float32 with
cuBLASLt's fast accumulation (XLA's choice for FP8 products of default precision) and are written in the compute
dtype; the scales are applied to the output, where XLA fuses them into the next elementwise work. Under a remat
policy that keeps the products, the quantized operands are made again in the backward (elementwise passes), not
kept.

Two scalings (a tensor's scale maps an absolute maximum, its amax, onto the format's largest value):
- dynamic (`fp8_matmul`): the scale is the tensor's own amax, taken when the tensor is made, as torchao's
  tensorwise float8 does. Exact, but the tensor is read twice: once for its amax, once to quantize it.
- delayed (`fp8_matmul_delayed`, as Transformer Engine and flax's fp8_ops do) for the activation and the output
  gradient: the scale comes from an amax history of the previous steps, so it is known before the tensor is read,
  and quantizing the tensor and measuring its amax (for the history) are one pass instead of two. A value above
  the history's amax saturates at the format's largest value; a fresh (zero) history trains its first step at
  scale 1. The weight is scaled by its own amax, as under dynamic scaling: one more read of a tensor that is small
  beside the activations, where a history's amax lags every weight that grows (all do in warmup: its largest
  values saturate) and a zero-initialized projection's (output_init="zero") flushes its first steps' values to
  zero.
Each projection keeps one float32 history [3, H] (`new_history`; H = HISTORY by default): row 0 the activation x,
row 1 the weight w (recorded, not used for its scale), row 2 the output gradient, newest amax first. The history
is updated by the convention "overwrite with gradient" (flax.linen.fp8_ops's): its cotangent is not a gradient but
the updated history (each row rolled by one, the step's amax at index 0), which the train step takes as the history's
new value.
Micro-batches that started from the same history combine their updated histories with `merge_histories`.
The projections of one x in a block scale x by the first one's x row (project_param, fp8_matmul_delayed_from):
the rows hold the same amaxes, and XLA then quantizes x once.
The train state holds the histories of the stacked blocks' projections nested like their parameters
(model.fp8_histories); the layer loop hands each block its layer's (block_histories), and a projection finds
its history by its parameter, so the modules hold no FP8 state. Other FP8 sites of a block (the training
attention core, mlra_jax.attention.fp8_attention) keep a history of rows of their own under their module's
path and a name of their own (module_site, site_history).

Only training takes this path (the loss function turns it on); evaluation, decoding and export run in
the compute dtype. A backend without FP8 GEMMs (a CPU, a GPU before compute capability 8.9) is reported
once and trains in the compute dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from mlra_jax import fp8_casts

log = logging.getLogger(__name__)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MAX = {E4M3: float(jnp.finfo(E4M3).max), E5M2: float(jnp.finfo(E5M2).max)}  # 448, 57344

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("mlra_jax_fp8_matmuls", default=False)
_STACKED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mlra_jax_fp8_histories", default=None)
_SITES: contextvars.ContextVar[_Sites | None] = contextvars.ContextVar("mlra_jax_fp8_sites", default=None)
_MODULE: contextvars.ContextVar[Any] = contextvars.ContextVar("mlra_jax_fp8_module", default=None)
# "bt<contracted>,<contracted><out>->bt<out>": x's leading batch and time axes, its other axes contracted
_PROJECTION = re.compile(r"^bt(\w+),(\w+)->bt(\w+)$")
HISTORY = 1  # the amax history's length, in steps: the previous step's (docs/performance.md has the loss study)
MARGIN = 0  # delayed scaling's headroom: scales map 2**MARGIN times the history's largest amax onto the format's max


def scale_of(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The per-tensor scale that maps x's absolute maximum onto `dtype`'s largest value (1 for a zero x)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / MAX[dtype], 1.0)


PROJECTION_ROWS = 3  # a projection's history rows: x, w, the output gradient


def new_history(length: int | None = None, rows: int = PROJECTION_ROWS) -> jax.Array:
    """A fresh amax history [rows, length] (a projection's rows: x, w, the output gradient): zeros, so the first
    step's scale is 1."""
    return jnp.zeros((rows, length or HISTORY), jnp.float32)


def scale_from_history(history_row: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The scale that maps 2**MARGIN times the largest amax of a history row onto `dtype`'s largest value (1 for a
    zero row)."""
    amax = jnp.max(history_row).astype(jnp.float32)
    return jnp.where(amax > 0, amax * 2.0**MARGIN / MAX[dtype], 1.0)


def merge_histories(a: jax.Array, b: jax.Array) -> jax.Array:
    """The updated histories of two micro-batches that started from the same history, combined: they differ only
    in the newest amax, where the maximum is the whole batch's."""
    return jnp.maximum(a, b)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x / scale in `dtype` (saturating at its largest value), as x times the scale's reciprocal: the FP8 cast
    kernel's arithmetic (fp8_casts), so that both paths round alike."""
    return jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -MAX[dtype], MAX[dtype]).astype(dtype)


def gemm(a: jax.Array, b: jax.Array, scale: jax.Array, out_dtype: jnp.dtype, exact_sums: bool = False) -> jax.Array:
    """a [M, K] . b [N, K] -> [M, N] (both contracting their last axis), times `scale`, in `out_dtype`. The GEMM
    accumulates in float32 and writes `out_dtype`, so that a remat policy that keeps the products keeps them
    in the compute dtype, as it does without FP8 (and as remat="auto" estimates). `exact_sums`: without cuBLASLt's
    fast accumulation (precision HIGHEST), whose partial sums in the tensor cores lose low bits over a long K."""
    precision = jax.lax.Precision.HIGHEST if exact_sums else None
    product = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=out_dtype)
    return (product.astype(jnp.float32) * scale).astype(out_dtype)


# cuBLASLt's FP8 GEMMs take every dimension in multiples of 16. Where one is not (the 2.9B MLRA-4's and MLA's FFN
# widths, 9880 and 9448) XLA pads the quantized operand, a transposed copy in a pass of its own (19 ms of pad fusions
# in one step of the 8-layer MLRA-4 proxy on an H200); padded here, before quantizing, the quantizing fusions write
# the padded operands and their transposed copies directly (no pad fusion left). The zeros add nothing to a product.
DIM_MULTIPLE = 16


def _padded(x: jax.Array) -> jax.Array:
    """x [R, C] with zero rows and columns up to multiples of DIM_MULTIPLE."""
    pads = [(0, -size % DIM_MULTIPLE) for size in x.shape]
    return jnp.pad(x, pads) if any(high for _, high in pads) else x


def _quantized_forward(
    x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array, dtype: jnp.dtype, cast_kernel: bool
):
    """x [M, K] @ w [K, N] in FP8, the backward's residuals, and the amaxes of x and w."""
    (m, _), n = x.shape, w.shape[1]
    x8, x8_t, x_amax = fp8_casts.both_layouts(x, 1.0 / x_scale, E4M3, DIM_MULTIPLE, cast_kernel)
    w8 = quantize(_padded(w), w_scale, E4M3)  # [K, N]: the input gradient's operand; XLA makes w8.T with it
    product = gemm(x8, w8.T, x_scale * w_scale, dtype)[:m, :n]  # [M, K] . [N, K]
    return product, (x8_t, w8, x_scale, w_scale), (x_amax, _amax(w))


def _quantized_backward(residuals, grad: jax.Array, g_scale: jax.Array, dtype: jnp.dtype, k: int, cast_kernel: bool):
    """The gradients of x [M, K] and w [K, N] for grad [M, N] from the forward's padded FP8 operands, and the
    amax of grad."""
    x8_t, w8, x_scale, w_scale = residuals
    m, n = grad.shape
    g8, g8_t, g_amax = fp8_casts.both_layouts(grad, 1.0 / g_scale, E5M2, DIM_MULTIPLE, cast_kernel)  # [M, N], [N, M]
    grad_x = gemm(g8, w8, g_scale * w_scale, dtype)[:m, :k]  # [M, N] . [K, N] -> [M, K]
    grad_w = gemm(x8_t, g8_t, x_scale * g_scale, dtype)[:k, :n]  # [K, M] . [N, M] -> [K, N]
    return grad_x, grad_w, g_amax


def fp8_matmul(x: jax.Array, w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N], both and the result (and the gradients) in `dtype`, with FP8 operands in
    the forward and the backward, each scaled by its own amax (dynamic scaling)."""
    return _dynamic(x, w, dtype, x.shape[1], fp8_casts.active())


# The custom VJPs take whether the cast kernel runs as an argument: their backward is traced after the forward,
# outside the `matmuls` context that chose it.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dynamic(x: jax.Array, w: jax.Array, dtype: jnp.dtype, k: int, cast_kernel: bool) -> jax.Array:
    return _forward(x, w, dtype, k, cast_kernel)[0]


def _forward(x: jax.Array, w: jax.Array, dtype: jnp.dtype, k: int, cast_kernel: bool):
    return _quantized_forward(x, w, scale_of(x, E4M3), scale_of(w, E4M3), dtype, cast_kernel)[:2]


def _backward(dtype: jnp.dtype, k: int, cast_kernel: bool, residuals, grad: jax.Array):
    return _quantized_backward(residuals, grad, scale_of(grad, E5M2), dtype, k, cast_kernel)[:2]


_dynamic.defvjp(_forward, _backward)


def fp8_matmul_delayed(x: jax.Array, w: jax.Array, history: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """fp8_matmul with delayed scaling: x and the output gradient are scaled by history [3, H]'s rows 0 and 2, w by
    its own amax. The cotangent of `history` is not a gradient but the updated history ("overwrite with gradient"):
    each row rolled by one, newest first, with this product's amax of x, w and the output gradient at index 0."""
    return fp8_matmul_delayed_from(x, w, history, history[0], dtype)


def fp8_matmul_delayed_from(
    x: jax.Array, w: jax.Array, history: jax.Array, x_history: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    """fp8_matmul_delayed with x scaled by `x_history` [H] (the amaxes of x's earlier steps) instead of history's
    row 0, which is still updated with this product's amax of x. Products of one x whose histories' rows 0 hold the
    same amaxes (each records x's) take one of those rows: x is then quantized by the same operations in each, and
    XLA computes it once (also its amax and its transposed copy for the weight gradient) instead of once per
    product. x_history's cotangent is zero."""
    return _delayed(x, w, history, x_history, dtype, x.shape[1], fp8_casts.active())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _delayed(
    x: jax.Array, w: jax.Array, history: jax.Array, x_history: jax.Array, dtype: jnp.dtype, k: int, cast_kernel: bool
):
    return _delayed_forward(x, w, history, x_history, dtype, k, cast_kernel)[0]


def _delayed_forward(
    x: jax.Array, w: jax.Array, history: jax.Array, x_history: jax.Array, dtype: jnp.dtype, k: int, cast_kernel: bool
):
    x_scale, w_scale = scale_from_history(x_history, E4M3), scale_of(w, E4M3)  # the weight by its own amax
    product, residuals, (x_amax, w_amax) = _quantized_forward(x, w, x_scale, w_scale, dtype, cast_kernel)
    return product, (residuals, history, x_amax, w_amax, jnp.zeros_like(x_history))  # amaxes: in the passes


def _delayed_backward(dtype: jnp.dtype, k: int, cast_kernel: bool, residuals, grad: jax.Array):
    residuals, history, x_amax, w_amax, x_history_cotangent = residuals
    g_scale = scale_from_history(history[2], E5M2)
    grad_x, grad_w, g_amax = _quantized_backward(residuals, grad, g_scale, dtype, k, cast_kernel)
    amaxes = jnp.stack([x_amax, w_amax, g_amax])[:, None]
    updated = jnp.concatenate([amaxes, history[:, :-1]], axis=1).astype(jnp.float32)
    return grad_x, grad_w, updated, x_history_cotangent


_delayed.defvjp(_delayed_forward, _delayed_backward)


def fp8_project(
    x: jax.Array,
    w: jax.Array,
    spec: str,
    dtype: jnp.dtype,
    history: jax.Array | None = None,
    x_history: jax.Array | None = None,
) -> jax.Array | None:
    """einsum(spec, x, w) through fp8_matmul when `spec` is a projection (x [B, T, in...], w [in..., out...],
    out [B, T, out...]), through fp8_matmul_delayed_from with the projection's amax `history` [3, H] when given (x
    scaled by `x_history` where given, else by history's row 0); None for any other product."""
    match = _PROJECTION.match(spec.replace(" ", ""))
    if match is None:
        return None
    x_in, w_axes, out = match.groups()
    if not w_axes.startswith(x_in) or w_axes[len(x_in) :] != out:
        return None
    batch, time = x.shape[:2]
    contracted = math.prod(x.shape[2:])
    x, w = x.astype(dtype), w.astype(dtype)
    x2, w2 = x.reshape(batch * time, contracted), w.reshape(contracted, -1)
    if history is None:
        result = fp8_matmul(x2, w2, dtype)
    elif x_history is None:
        result = fp8_matmul_delayed(x2, w2, history, dtype)
    else:
        result = fp8_matmul_delayed_from(x2, w2, history, x_history, dtype)
    return result.reshape(batch, time, *w.shape[len(x_in) :])


def active() -> bool:
    """Whether projections run through FP8 here (inside `matmuls`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def matmuls(enabled: bool, histories: dict[str, Any] | None = None, casts: str = "auto") -> Iterator[None]:
    """Inside: the projections of a model traced here run as FP8 matmuls when `enabled`, with delayed scaling when
    `histories` (the amax histories of the stacked blocks' projections, nested like their parameters) are given,
    else dynamic scaling; their operands quantized as model.fp8_casts=`casts` says."""
    tokens = _ACTIVE.set(enabled), _STACKED.set(histories if enabled else None)
    try:
        with fp8_casts.casts(casts if enabled else "xla"):
            yield
    finally:
        _STACKED.reset(tokens[1])
        _ACTIVE.reset(tokens[0])


def stacked_histories() -> dict[str, Any] | None:
    """The stacked blocks' amax histories of the enclosing `matmuls` (None without delayed scaling)."""
    return _STACKED.get()


@dataclasses.dataclass
class _Sites:
    """One block's FP8 sites while it is traced: its parameters' and modules' paths by identity, their
    histories, and the rows of the history of each site that took the FP8 path, by path."""

    paths: dict[int, tuple[str, ...]]
    histories: dict[tuple[str, ...], jax.Array]
    taken: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)
    # id(x) -> (x, the x row of the first projection of x): the later projections of x scale it by that row
    inputs: dict[int, tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=dict)


def _node_paths(block: nnx.Module) -> dict[int, tuple[str, ...]]:
    return {
        id(node): tuple(map(str, path))
        for path, node in nnx.iter_graph(block)
        if isinstance(node, (nnx.Param, nnx.Module))
    }


@contextlib.contextmanager
def block_histories(block: nnx.Module, histories: dict[str, Any] | None) -> Iterator[None]:
    """Inside: the FP8 sites of `block` (one layer) read their amax history from `histories` (nested like the
    block's parameters; None: dynamic scaling)."""
    if histories is None:
        yield
        return
    with _tracing(_Sites(_node_paths(block), traverse_util.flatten_dict(histories))):
        yield


SHARE_INPUT_SCALES = True  # projections of one x in a block scale it by the first one's x row (quantized once)


def project_param(x: jax.Array, kernel: nnx.Param, spec: str, dtype: jnp.dtype) -> jax.Array | None:
    """fp8_project of x and a module's parameter, with the parameter's amax history where its block has one
    (block_histories); None for a product that is not a projection. Under delayed scaling the projections of one
    x (q, k and v of x; the MLP's gate and up) scale x by the first one's x row, so that XLA quantizes x once
    (fp8_matmul_delayed_from): the rows hold the same amaxes, each recording x's."""
    sites = _SITES.get()
    path = sites.paths.get(id(kernel)) if sites is not None else None
    history = sites.histories.get(path) if path is not None else None
    first = sites.inputs.get(id(x)) if history is not None and SHARE_INPUT_SCALES else None
    x_history = first[1] if first is not None and first[0] is x else None
    product = fp8_project(x, kernel[...], spec, dtype, history, x_history)
    if product is not None and path is not None:
        sites.taken[path] = PROJECTION_ROWS
        if history is not None and SHARE_INPUT_SCALES and x_history is None:  # x's first FP8 projection
            sites.inputs[id(x)] = (x, history[0])
    return product


@contextlib.contextmanager
def module_site(module: nnx.Module) -> Iterator[None]:
    """Inside: FP8 sites that are not projections (site_history) belong to `module`."""
    token = _MODULE.set(module)
    try:
        yield
    finally:
        _MODULE.reset(token)


def site_module() -> nnx.Module | None:
    """The module of the enclosing module_site (None outside one)."""
    return _MODULE.get()


def site_path(name: str) -> tuple[str, ...] | None:
    """The path in its block's histories of the site `name` of the enclosing module_site's module: the module's
    path, then `name` (which no parameter of the module has); None outside a block's sites."""
    sites, module = _SITES.get(), _MODULE.get()
    path = sites.paths.get(id(module)) if sites is not None and module is not None else None
    return None if path is None else (*path, name)


def site_history(name: str, rows: int) -> jax.Array | None:
    """The amax history [rows, H] of the site `name` of the enclosing module_site's module, recorded as taking the
    FP8 path (history_rows); None where its block has none (dynamic scaling, outside a block, a history that
    history_rows did not make)."""
    path = site_path(name)
    if path is None:
        return None
    sites = _SITES.get()
    sites.taken[path] = rows
    history = sites.histories.get(path)
    return history if history is not None and history.shape[0] == rows else None


def history_rows(block: nnx.Module, *inputs: Any) -> dict[tuple[str, ...], int]:
    """The FP8 sites of `block` (abstract or not) that take the FP8 path when it runs on `inputs` (arrays or
    ShapeDtypeStructs; traced abstractly: nothing is computed): their paths (a projection's is its parameter's)
    and their histories' rows."""
    graphdef, state = nnx.split(block)
    taken: dict[tuple[str, ...], int] = {}

    def run(state: Any, *inputs: Any) -> None:
        traced = nnx.merge(graphdef, state)
        sites = _Sites(_node_paths(traced), {})
        with matmuls(True), _tracing(sites):
            traced(*inputs)
        taken.update(sites.taken)

    jax.eval_shape(run, state, *inputs)
    return dict(sorted(taken.items()))


@contextlib.contextmanager
def _tracing(sites: _Sites) -> Iterator[None]:
    token = _SITES.set(sites)
    try:
        yield
    finally:
        _SITES.reset(token)


def fresh_histories(rows: dict[tuple[str, ...], int], layers: int, length: int | None = None) -> dict[str, Any]:
    """Zero amax histories [layers, rows, length] for the sites at the paths of `rows` (history_rows), nested like
    the parameters."""
    return traverse_util.unflatten_dict(
        {path: jnp.zeros((layers, n, length or HISTORY), jnp.float32) for path, n in rows.items()}
    )


# An amax above this is no tensor's of a training run (the loss would have overflowed long before): a restored
# history holding one, or a NaN, an inf or a negative value, is damaged
AMAX_LIMIT = 2.0**64


def damaged_histories(histories: dict[str, Any]) -> list[str]:
    """The dotted names of the histories (arrays [layers, rows, H], nested) that hold a NaN, an inf, a negative value
    or an amax above AMAX_LIMIT; only the verdicts come to the host."""
    flat = traverse_util.flatten_dict(histories)
    return [
        ".".join(map(str, path))
        for path, history in flat.items()
        if not bool(jnp.all(jnp.isfinite(history) & (history >= 0) & (history <= AMAX_LIMIT)))
    ]


def history_names(histories: dict[str, Any]) -> list[str]:
    """The dotted names of the histories (nested), as damaged_histories gives them."""
    return [".".join(map(str, path)) for path in traverse_util.flatten_dict(histories)]


def completed_histories(restored: dict[str, Any], fresh: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`fresh` (every site's, nested) with the histories that `restored` holds in their place, and the dotted names
    of those that stay fresh."""
    kept, flat = traverse_util.flatten_dict(restored), traverse_util.flatten_dict(fresh)
    merged = {path: kept.get(path, history) for path, history in flat.items()}
    return traverse_util.unflatten_dict(merged), [".".join(map(str, p)) for p in flat if p not in kept]


def reset_histories(histories: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`histories` with those of `names` (dotted, as damaged_histories gives them) fresh (zeros), each in its own
    sharding."""
    zeros = lambda h: jax.jit(jnp.zeros_like, out_shardings=h.sharding)(h)
    flat = traverse_util.flatten_dict(histories)
    return traverse_util.unflatten_dict(
        {path: zeros(h) if ".".join(map(str, path)) in names else h for path, h in flat.items()}
    )


def supported(device: jax.Device | None = None) -> bool:
    """Whether the device has FP8 GEMMs: an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper, ...)."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return False
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return (major, minor) >= (8, 9)


@functools.cache
def _report_fallback(kind: str) -> None:
    log.warning(
        "model.matmul_dtype=float8: %s has no FP8 GEMMs (an NVIDIA GPU of compute capability 8.9 or later "
        "does); training in the compute dtype",
        kind,
    )


def training_matmuls(matmul_dtype: str, device: jax.Device | None = None) -> bool:
    """Whether a train step for `matmul_dtype` takes the FP8 path on `device` (a fallback is logged once)."""
    if matmul_dtype != "float8":
        return False
    device = device or jax.devices()[0]
    if supported(device):
        return True
    _report_fallback(device.device_kind)
    return False


def describe_histories(histories: dict[str, Any]) -> str:
    """One line on a train state's amax histories (arrays or ShapeDtypeStructs [layers, rows, H] per site)."""
    leaves = jax.tree.leaves(histories)
    if not leaves:
        return "FP8 amax histories: none"
    layers, _, length = leaves[0].shape
    projections = sum(leaf.shape[1] == PROJECTION_ROWS for leaf in leaves)
    others = [leaf.shape[1] for leaf in leaves if leaf.shape[1] != PROJECTION_ROWS]
    sites = f"{projections} projections x {layers} layers x 3 tensors (x, w, gradient)"
    if others:
        sites += f" and {len(others)} attention cores x {layers} layers x {others[0]} tensors"
    return f"FP8 amax histories: {sites} x {length} steps, in the train state and its checkpoints, replicated"


def describe(
    matmul_dtype: str, device: jax.Device | None = None, *, scaling: str = "delayed", casts: str = "auto"
) -> str:
    """One line on how a train step's projections run on `device` (for --dry_run), with `scaling` "delayed" or
    "dynamic" and model.fp8_casts=`casts`."""
    if matmul_dtype != "float8":
        return "projections: the compute dtype"
    device = device or jax.devices()[0]
    if supported(device):
        scales = {"delayed": f"delayed scaling (amax history of {HISTORY})", "dynamic": "dynamic scaling"}[scaling]
        quantized = "the FP8 cast kernel" if casts != "xla" else "XLA's fusions"
        return (
            f"projections: FP8 GEMMs (e4m3 / e5m2, per-tensor {scales}) on {device.device_kind}; activations and "
            f"gradients quantized by {quantized}"
        )
    return f"projections: float8 asked for, but {device.device_kind} has no FP8 GEMMs: the compute dtype"
