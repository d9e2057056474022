"""FP8 training attention (`model.matmul_dtype=float8` with delayed scaling): cuDNN's FP8 flash attention.

With `model.fp8_attention=true` (off by default: on an H100 its forward + backward runs at 0.66x bf16 cuDNN's
rate), in a train step whose projections run in FP8 with delayed scaling (mlra_jax.fp8), the causal attention core
of a layer whose queries, keys and values are 128 wide (MHA, MQA, GQA, TPA and GTA at the paper's head_dim;
not MFA's 256 nor the latent family's 192-wide keys) runs on cuDNN's FP8 flash attention, forward and
backward, through JAX's private module (`jax._src.cudnn.fused_attention_stablehlo`: the halves of its FP8
custom_vjp, `_dot_product_attention_fp8_fwd_rule` and `_bwd_rule`, the same from jax 0.10.2 to 0.11.x):

- q, k and v are quantized to e4m3 with per-tensor scales, in the passes that measure their amaxes;
- the forward multiplies Q K^T in FP8 (float32 accumulation), takes the softmax in float32 as a flash kernel
  does, quantizes the unnormalized exponentials (at most 1) to e4m3 (scale S), multiplies them by V in FP8,
  divides by the rows' sums and writes the output O in e4m3 (scale O), which is dequantized here into the
  compute dtype;
- the backward quantizes dO to e4m3, recomputes P from the softmax statistics, and forms dV = P^T dO,
  dP = dO V^T, dS = P (dP - rowsum(dO O)) times the softmax scale (quantized to e4m3 with scale dP: cuDNN's
  "dP"), dQ = dS K and dK = dS^T Q, each written in e4m3 with its own scale and dequantized here.

cuDNN's convention: a "descale" multiplies an FP8 value back (fp8.py's scale: amax / 448), a "scale"
multiplies into FP8 (its inverse). The ten scales come from the site's amax history [10, H] (ROWS), as the
projections' do (fp8.scale_from_history: a fresh history trains its first step at scale 1, which flushes the
small dO to zero, so that step's gradients and dS amax are zero and the second step's dS flushes at scale 1; every
tensor has its scale from the third step on); the history's
cotangent is the updated history (fp8's "overwrite with gradient"): each row rolled by one, with this step's
amaxes of q, k, v and dO measured here and those of P, O, dS, dQ, dK and dV as the kernels return them.
The site is the attention module's: its history sits in the train state at the module's path, then SITE.
What the backward keeps is q, k, v and O in FP8 and the softmax statistics: half the bf16 kernel's bytes.

Where cuDNN's FP8 attention cannot run (no NVIDIA GPU of compute capability 9.0 or later, cuDNN before 9.1
or 9.10.0, a JAX other than VERIFIED_JAX, widths other than 128, sequences that are not multiples of 128, an
explicit mask, `attention_impl` xla or splash, dynamic scaling, `model.fp8_attention=false`), the attention stays
in the compute dtype; a float8 run says why once.

INTERPRET: the tests' stand-in. `reference_forward` and `reference_backward`, jnp versions of cuDNN's FP8
graphs as cuDNN's frontend documents them, run where cuDNN's kernels would, on any backend, so that the
scaling, the histories and the sharding around the kernels are tested on the CPU. Never set in the library.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from mlra_jax import fp8
from mlra_jax.attention.fused import cudnn_module, shard_plan
from mlra_jax.config import ModelConfig
from mlra_jax.platform import target_platform

log = logging.getLogger(__name__)

INTERPRET = False  # the tests' stand-in: the jnp reference runs where cuDNN's FP8 kernels would
SITE = "fp8_dot_product_attention"  # the attention core's site under its module's path (no parameter's name)
ROWS = ("q", "k", "v", "s", "o", "do", "dp", "dq", "dk", "dv")  # the history's rows, one per scaled tensor
WIDTH = 128  # the one head width cuDNN's FP8 attention trains
BLOCK = 128  # the sequence lengths it trains are multiples of this
VERIFIED_JAX = ("0.11.",)  # the JAX versions whose cuDNN FP8 backward was checked against float32 (a GPU test)
IMPLS = ("auto", "cudnn", "pallas", "mlra_kernel")  # attention_impl values under which cuDNN runs the core
_E4M3 = fp8.E4M3
_MAX = float(jnp.finfo(_E4M3).max)  # 448


# ----------------------------------------------------------------------------- where it runs
def eligible(q: jax.Array, k: jax.Array, v: jax.Array, impl: str, masked: bool) -> bool:
    """Whether an attention call is FP8 attention's by its structure (the model's, not the device's nor the
    sequence length's): causal without an explicit mask, under a cuDNN impl, all widths 128."""
    return not masked and impl in IMPLS and q.shape[-1] == k.shape[-1] == v.shape[-1] == WIDTH


def device_problem(device: jax.Device | None = None) -> str | None:
    """Why cuDNN's FP8 attention cannot train on `device` (default: the first), or None where it can."""
    device = device or jax.devices()[0]
    if device.platform != "gpu" or target_platform() != "gpu":
        return f"cuDNN's FP8 attention needs an NVIDIA GPU, not {device.device_kind}"
    capability = str(getattr(device, "compute_capability", "0.0"))
    if tuple(int(part) for part in capability.split(".")[:2]) < (9, 0):
        return f"cuDNN's FP8 attention trains on compute capability 9.0 or later; {device.device_kind} has {capability}"
    try:
        module = cudnn_module()
        version = module.check_cudnn_version()
    except (ImportError, AttributeError, RuntimeError) as err:
        return f"JAX's cuDNN attention is unavailable ({err})"
    if version < 90100 or version == 91000:
        return f"cuDNN's FP8 attention backward needs cuDNN 9.1 or later, not 9.10.0 (this is {version})"
    if not all(hasattr(module, name) for name in ("_dot_product_attention_fp8_fwd_rule", "fp8_params_keys_bwd")):
        return f"this JAX ({jax.__version__}) has no FP8 attention rules in jax._src.cudnn"
    if not jax.__version__.startswith(VERIFIED_JAX):
        return (
            f"its backward's scale operands go in the order XLA reads them in jax {', '.join(VERIFIED_JAX)}x "
            f"(BACKWARD_SCALE_ORDER), not checked against float32 attention on jax {jax.__version__}"
        )
    return None


def problem(q: jax.Array, k: jax.Array, v: jax.Array) -> str | None:
    """Why cuDNN's FP8 attention cannot train this (eligible) call here, or None where it can."""
    if q.shape[1] != k.shape[1]:
        return f"its causal mask here needs as many queries as keys ({q.shape[1]} vs {k.shape[1]})"
    if q.shape[1] % BLOCK:
        return f"cuDNN's FP8 attention trains sequences of a multiple of {BLOCK} tokens, not {q.shape[1]}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it takes bfloat16 or float16 inputs, not {q.dtype}"
    if INTERPRET:
        return None
    reason = device_problem()
    if reason is not None:
        return reason
    module = cudnn_module()
    try:
        module.check_is_flash_attention(
            q, k, v, module.AttentionLayout.BTNH.value, module.check_cudnn_version(), False, True, is_fp8=True
        )
    except NotImplementedError as err:
        return str(err)
    return None


@functools.cache
def _report_fallback(reason: str) -> None:
    log.warning("model.matmul_dtype=float8: the attention core stays in the compute dtype: %s", reason)


def history(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str, masked: bool) -> jax.Array | None:
    """The amax history [10, H] with which this attention call runs on cuDNN's FP8 attention, or None (the
    compute dtype). In an FP8 train step (fp8.active) an eligible call inside an attention module's
    fp8.module_site is that module's FP8 site, recorded as such (fp8.history_rows) whatever the device; where its
    block has no history (dynamic scaling) or the kernel cannot run it, the step says why once."""
    if not fp8.active() or fp8.site_module() is None or not eligible(q, k, v, impl, masked):
        return None
    if fp8.site_path(SITE) is None:
        _report_fallback("FP8 attention takes delayed scaling (model.fp8_scaling=delayed)")
        return None
    found = fp8.site_history(SITE, len(ROWS))
    if found is None:  # fp8.history_rows' abstract trace: the site is recorded, nothing runs
        return None
    reason = problem(q, k, v)
    if reason is not None:
        _report_fallback(reason)
        return None
    return found


# ----------------------------------------------------------------------------- the attention
def new_history(length: int | None = None) -> jax.Array:
    """A fresh amax history [10, length] (ROWS): zeros, so the first step's scales are 1."""
    return fp8.new_history(length, rows=len(ROWS))


def _scales(history: jax.Array) -> dict[str, jax.Array]:
    return {name: fp8.scale_from_history(history[i], _E4M3) for i, name in enumerate(ROWS)}


def kernel_params(scales: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """cuDNN's fp8_params from fp8.py's scales (amax / 448 per tensor): a descale is the scale, a scale its
    inverse; the amax entries are the backward's placeholders."""
    params = {f"descale_{name}": scales[row] for name, row in (("q", "q"), ("k", "k"), ("v", "v"), ("s", "s"))}
    params |= {"descale_o": scales["o"], "descale_dO": scales["do"], "descale_dP": scales["dp"]}
    params |= {f"scale_{name}": 1.0 / scales[row] for name, row in (("s", "s"), ("o", "o"), ("dP", "dp"))}
    params |= {f"scale_{name}": 1.0 / scales[name.lower()] for name in ("dQ", "dK", "dV")}
    params |= {f"amax_{name}": jnp.zeros((), jnp.float32) for name in ("dQ", "dK", "dV", "dP")}
    return {name: jnp.reshape(value, (1, 1, 1, 1)).astype(jnp.float32) for name, value in params.items()}


def cudnn_forward(q8: jax.Array, k8: jax.Array, v8: jax.Array, params: dict[str, jax.Array], scale: float):
    """cuDNN's causal FP8 forward (training): (O in e4m3, amax of P, amax of O, softmax statistics [B, H, T])."""
    module = cudnn_module()
    layout, version = module.AttentionLayout.BTNH.value, module.check_cudnn_version()
    (out, amax_s, amax_o), residuals = module._dot_product_attention_fp8_fwd_rule(
        q8, k8, v8, params, scale, True, layout, version
    )
    return out, amax_s, amax_o, residuals[3]  # JAX's residuals: q, k, v, statistics, output, backward scales


# The order in which XLA's cuDNN FP8 backward reads its twelve scale operands. JAX's lowering passes them in the order
# of its fp8_params_keys_bwd (descale_o, descale_dO, descale_s, ..., scale_dQ, scale_dK, scale_dV, scale_dP), so
# that with scales other than 1 cuDNN took descale_o for descale_s, scale_dQ for scale_dP and so on (gradients
# off by the ratios of the scales; measured on an H200 with jax 0.11, one scale at a time). JAX's own test runs
# every scale at 1, where the order does not show. The operands go in this order instead.
BACKWARD_SCALE_ORDER = (
    "descale_q", "descale_k", "descale_v", "descale_s", "descale_o", "descale_dO", "descale_dP",
    "scale_s", "scale_dP", "scale_dQ", "scale_dK", "scale_dV",
)  # fmt: skip


def cudnn_backward(q8, k8, v8, out8, do8, stats, params: dict[str, jax.Array], scale: float):
    """cuDNN's causal FP8 backward: (dQ, dK, dV in e4m3, amaxes of dQ, dK, dV and dS)."""
    module = cudnn_module()
    layout, version = module.AttentionLayout.BTNH.value, module.check_cudnn_version()
    residuals = (q8, k8, v8, stats, out8, [params[name] for name in BACKWARD_SCALE_ORDER])
    dq, dk, dv, amaxes = module._dot_product_attention_fp8_bwd_rule(
        scale, True, layout, version, residuals, (do8, None, None)
    )
    return dq, dk, dv, amaxes["amax_dQ"], amaxes["amax_dK"], amaxes["amax_dV"], amaxes["amax_dP"]


def _to_e4m3(x: jax.Array) -> jax.Array:
    return jnp.clip(x, -_MAX, _MAX).astype(_E4M3)


def _grouped_logits(q8: jax.Array, k8: jax.Array, descale: jax.Array, scale: float) -> jax.Array:
    """Causal logits [B, H_kv, G, T, S] of FP8 q [B, T, H_kv * G, D] and k [B, S, H_kv, D] (query head i reads KV
    head i // G), descaled, in float32; a masked logit is float32's lowest."""
    b, t, hq, d = q8.shape
    q = q8.astype(jnp.float32).reshape(b, t, k8.shape[2], hq // k8.shape[2], d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k8.astype(jnp.float32), precision="highest") * (descale * scale)
    visible = jnp.tril(jnp.ones((t, k8.shape[1]), bool))
    return jnp.where(visible, logits, jnp.finfo(jnp.float32).min)


def reference_forward(q8: jax.Array, k8: jax.Array, v8: jax.Array, params: dict[str, jax.Array], scale: float):
    """cuDNN's FP8 forward graph in jnp (float32), as a flash kernel runs it: S = Q K^T descale_q descale_k scale,
    causal; the exponentials E = exp(S - rowmax S) (at most 1), quantized with scale_s (a causal row's first key
    makes amax_s 1); O = (E V) descale_s descale_v / rowsum(E), amax_o its amax, quantized with scale_o; the
    statistics are the rows' logsumexp. The kernel's running maximum is the row's maximum here: the same within
    rounding, as each tile's exponentials are rescaled in float32 after the product."""
    p = {name: value.reshape(()) for name, value in params.items()}
    b, t, hq, d = q8.shape
    logits = _grouped_logits(q8, k8, p["descale_q"] * p["descale_k"], scale)
    top = jnp.max(logits, axis=-1, keepdims=True)
    exps = jnp.exp(logits - top)
    sums = jnp.sum(exps, axis=-1)
    e8 = _to_e4m3(exps * p["scale_s"]).astype(jnp.float32)
    out = jnp.einsum("bkgts,bskd->btkgd", e8, v8.astype(jnp.float32), precision="highest")
    out = out * (p["descale_s"] * p["descale_v"]) / jnp.moveaxis(sums, -1, 1)[..., None]
    stats = top[..., 0] + jnp.log(sums)
    amax = lambda x: jnp.max(jnp.abs(x)).reshape(1, 1, 1, 1)  # noqa: E731
    return _to_e4m3(out * p["scale_o"]).reshape(b, t, hq, d), amax(exps), amax(out), stats.reshape(b, hq, t)


def reference_backward(q8, k8, v8, out8, do8, stats, params: dict[str, jax.Array], scale: float):
    """cuDNN's FP8 backward graph in jnp (float32): D = rowsum(dO O) descale_dO descale_o; P recomputed from the
    statistics and quantized with scale_s; dV = P8^T dO descale_s descale_dO; dS = P (dO V^T descale_dO descale_v
    - D) scale, amax_dP its amax, quantized with scale_dP; dQ = dS8 K descale_dP descale_k, dK = dS8^T Q descale_dP
    descale_q; each of dQ, dK, dV with its amax, quantized with its scale."""
    p = {name: value.reshape(()) for name, value in params.items()}
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    b, t, hq, d = q8.shape
    hk = k8.shape[2]
    grouped = lambda x: f32(x).reshape(b, t, hk, hq // hk, d)  # noqa: E731
    q, do, out = grouped(q8), grouped(do8), grouped(out8)
    row_sums = jnp.einsum("btkgd,btkgd->bkgt", do, out) * (p["descale_dO"] * p["descale_o"])
    logits = _grouped_logits(q8, k8, p["descale_q"] * p["descale_k"], scale)
    probs = jnp.exp(logits - stats.reshape(b, hk, hq // hk, t)[..., None])
    p8 = f32(_to_e4m3(probs * p["scale_s"]))
    dv = jnp.einsum("bkgts,btkgd->bskd", p8, do, precision="highest") * (p["descale_s"] * p["descale_dO"])
    dp = jnp.einsum("btkgd,bskd->bkgts", do, f32(v8), precision="highest") * (p["descale_dO"] * p["descale_v"])
    ds = probs * (dp - row_sums[..., None]) * scale
    ds8 = f32(_to_e4m3(ds * p["scale_dP"]))
    dq = jnp.einsum("bkgts,bskd->btkgd", ds8, f32(k8), precision="highest") * (p["descale_dP"] * p["descale_k"])
    dk = jnp.einsum("bkgts,btkgd->bskd", ds8, q, precision="highest") * (p["descale_dP"] * p["descale_q"])
    dq = dq.reshape(b, t, hq, d)
    amax = lambda x: jnp.max(jnp.abs(x)).reshape(1, 1, 1, 1)  # noqa: E731
    grads = (_to_e4m3(g * p[f"scale_{name}"]) for g, name in ((dq, "dQ"), (dk, "dK"), (dv, "dV")))
    return (*grads, amax(dq), amax(dk), amax(dv), amax(ds))


def _kernels():
    return (reference_forward, reference_backward) if INTERPRET else (cudnn_forward, cudnn_backward)


def _on_shards(fn, plan, specs: tuple[tuple, tuple] | None, *args: Any) -> Any:
    """fn(*args), on each device's shard (one shard_map over plan.axes with specs = (in, out)) under a plan."""
    if plan is None:
        return fn(*args)
    in_specs, out_specs = specs
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(plan.axes), check_vma=False)(*args)


def _sharded_forward(q8, k8, v8, params, scale: float):
    """The forward kernel on each device's shard (fused.shard_plan); its amaxes are the whole call's."""
    plan = shard_plan(q8, k8)

    def run(q8, k8, v8, params):
        out8, amax_s, amax_o, stats = _kernels()[0](q8, k8, v8, params, scale)
        if plan is not None:
            amax_s, amax_o = (jax.lax.pmax(a, tuple(plan.axes)) for a in (amax_s, amax_o))
        return out8, amax_s, amax_o, stats

    specs = None if plan is None else ((plan.q, plan.kv, plan.kv, P()), (plan.q, P(), P(), plan.stats))
    return _on_shards(run, plan, specs, q8, k8, v8, params)


def _sharded_backward(q8, k8, v8, out8, do8, stats, params, scales, scale: float, dtype: jnp.dtype):
    """The backward kernel on each device's shard: the gradients dequantized into `dtype` (a KV head's summed
    over the devices that split its query heads) and the whole call's amaxes of dQ, dK, dV and dS."""
    plan = shard_plan(q8, k8)

    def run(q8, k8, v8, out8, do8, stats, params, scales):
        dq8, dk8, dv8, *amaxes = _kernels()[1](q8, k8, v8, out8, do8, stats, params, scale)
        dq, dk, dv = (g.astype(jnp.float32) * scales[name] for g, name in ((dq8, "dq"), (dk8, "dk"), (dv8, "dv")))
        if plan is not None:
            amaxes = [jax.lax.pmax(a, tuple(plan.axes)) for a in amaxes]
            if plan.kv_partial:
                dk, dv = (jax.lax.psum(g, plan.kv_partial) for g in (dk, dv))
        return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype), *amaxes

    specs = None
    if plan is not None:
        inputs = (plan.q, plan.kv, plan.kv, plan.q, plan.q, plan.stats, P(), P())
        specs = (inputs, (plan.q, plan.kv, plan.kv, P(), P(), P(), P()))
    return _on_shards(run, plan, specs, q8, k8, v8, out8, do8, stats, params, scales)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def fp8_attention(q: jax.Array, k: jax.Array, v: jax.Array, history: jax.Array, scale: float) -> jax.Array:
    """Causal attention of q [B, T, H, 128], k and v [B, T, H_kv, 128] (compute dtype) on cuDNN's FP8 attention
    with delayed scaling from `history` [10, H] (ROWS), in q's dtype. The cotangent of `history` is the updated
    history: each row rolled by one, newest first, this call's amaxes at index 0."""
    return _forward(q, k, v, history, scale)[0]


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, history: jax.Array, scale: float):
    scales = _scales(history)
    q8, k8, v8 = (fp8.quantize(x, scales[name], _E4M3) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    out8, amax_s, amax_o, stats = _sharded_forward(q8, k8, v8, kernel_params(scales), scale)
    out = (out8.astype(jnp.float32) * scales["o"]).astype(q.dtype)
    amaxes = jnp.stack([_amax(q), _amax(k), _amax(v), amax_s.reshape(()), amax_o.reshape(())])
    return out, (q8, k8, v8, out8, stats, history, amaxes)


def _backward(scale: float, residuals, grad: jax.Array):
    q8, k8, v8, out8, stats, history, forward_amaxes = residuals
    scales = _scales(history)
    do8 = fp8.quantize(grad, scales["do"], _E4M3)
    dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_ds = _sharded_backward(
        q8, k8, v8, out8, do8, stats, kernel_params(scales), scales, scale, grad.dtype
    )
    backward_amaxes = jnp.stack([_amax(grad), *(a.reshape(()) for a in (amax_ds, amax_dq, amax_dk, amax_dv))])
    amaxes = jnp.concatenate([forward_amaxes, backward_amaxes])
    return dq, dk, dv, jnp.concatenate([amaxes[:, None], history[:, :-1]], axis=1).astype(jnp.float32)


fp8_attention.defvjp(_forward, _backward)


# ----------------------------------------------------------------------------- reports
def sites(histories: dict[str, Any]) -> int:
    """How many attention cores a train state's FP8 histories hold (per layer)."""
    return sum(path[-1] == SITE for path in traverse_util.flatten_dict(histories))


def describe(cfg: ModelConfig, histories: dict[str, Any], seq_len: int, device: jax.Device | None = None) -> str:
    """One line on how a train step's attention core runs (for --dry_run), from the model, the train state's FP8
    histories (arrays or ShapeDtypeStructs), the sequence length and the device."""
    if cfg.matmul_dtype != "float8":
        return "attention core: the compute dtype"
    if cfg.fp8_scaling != "delayed":
        return "attention core: the compute dtype (FP8 attention takes model.fp8_scaling=delayed)"
    if not cfg.fp8_attention:
        return "attention core: the compute dtype (model.fp8_attention=false)"
    count = sites(histories)
    if not count:
        return (
            "attention core: the compute dtype (cuDNN's FP8 attention trains queries, keys and values 128 wide "
            "under attention_impl auto or cudnn; this model's are not)"
        )
    if seq_len % BLOCK:
        return f"attention core: the compute dtype (FP8 attention trains multiples of {BLOCK} tokens, not {seq_len})"
    device = device or jax.devices()[0]
    reason = device_problem(device)
    if reason is not None:
        return f"attention core: float8 asked for, but {reason}: the compute dtype"
    return (
        f"attention core: cuDNN FP8 flash attention (e4m3, per-tensor delayed scaling, amax history of "
        f"{fp8.HISTORY}) in {count} attention core(s) per layer on {device.device_kind}"
    )
