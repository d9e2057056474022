"""The shared scaled dot-product attention, with an explicit implementation choice.

Shapes: q [B, T, Hq, Dk], k [B, S, Hkv, Dk], v [B, S, Hkv, Dv] with Hq a multiple of
Hkv; query head i reads KV head i // (Hq // Hkv) (torch repeat_interleave). Dk may
differ from Dv (the latent variants attend with 192-wide keys and 128-wide values).
Logits and softmax are float32 whatever the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mlra_jax.attention import fp8_attention
from mlra_jax.attention.fused import choose, record
from mlra_jax.attention.latent_kernels import latent_decode_attention, use_kernel
from mlra_jax.layers import einsum

MASKED = float(jnp.finfo(jnp.float32).min)  # the logit of a key a query may not see
ATTENTION_INPUTS = ("attention_q", "attention_k", "attention_v")  # checkpoint names of what attention() attends with


def causal_mask(q_positions: jax.Array, kv_positions: jax.Array, kv_valid: jax.Array | None = None) -> jax.Array:
    """[B, T, S] bool: a query sees keys at positions <= its own (and only valid keys)."""
    mask = kv_positions[:, None, :] <= q_positions[:, :, None]
    if kv_valid is not None:
        mask = mask & kv_valid[:, None, :]
    return mask


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> int:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects 4-D q, k, v; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[-1] != k.shape[-1] or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise ValueError(f"incompatible attention shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads")
    return q.shape[2] // k.shape[2]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, mask: jax.Array | None) -> jax.Array:
    """Plain einsum attention; mask is [B, T, S] bool or None (no masking)."""
    groups = _check_shapes(q, k, v)
    b, t, hq, dk = q.shape
    q = q.reshape(b, t, hq // groups, groups, dk)
    logits = einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, MASKED)
    probs = jax.nn.softmax(logits, axis=-1)
    out = einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, v.shape[-1]).astype(v.dtype)


def latent_attention(
    q_rope: jax.Array,
    q_latent: jax.Array,
    k_rope: jax.Array,
    latent: jax.Array,
    *,
    scale: float,
    mask: jax.Array | None,
    impl: str = "xla",
) -> jax.Array:
    """MQA-style attention over a latent cache with a shared RoPE key (paper Step 2).

    Per latent block n: q = [q_rope || q_latent], k = [k_rope || latent_n], v = latent_n.
    q_rope [B, T, N, H, Dr], q_latent [B, T, N, H, R], k_rope [B, S, Dr], latent [B, S, N, R]
    -> [B, T, N, H, R]. No per-head key or value is ever formed. impl 'pallas' runs the
    decode kernel, 'auto' (and 'mlra_kernel') runs it where it can (one token on a Hopper GPU or a TPU);
    otherwise XLA (the flash kernels do not cover this shape).
    """
    if use_kernel("auto" if impl == "mlra_kernel" else impl, q_rope, latent):
        return latent_decode_attention(q_rope, q_latent, k_rope, latent, scale=scale, mask=mask)
    logits = (
        einsum("btnhr,bsnr->bnhts", q_latent, latent, preferred_element_type=jnp.float32)
        + einsum("btnhk,bsk->bnhts", q_rope, k_rope, preferred_element_type=jnp.float32)
    ) * scale
    if mask is None:
        positions = jnp.broadcast_to(jnp.arange(q_latent.shape[1]), q_latent.shape[:2])
        mask = causal_mask(positions, positions)
    logits = jnp.where(mask[:, None, None], logits, MASKED)
    probs = jax.nn.softmax(logits, axis=-1)
    out = einsum("bnhts,bsnr->btnhr", probs.astype(latent.dtype), latent, preferred_element_type=jnp.float32)
    return out.astype(latent.dtype)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, impl: str = "xla", mask: jax.Array | None = None
) -> jax.Array:
    """Causal attention over a full sequence (mask=None) or under an explicit [B, T, S] mask.

    impl: 'xla' (einsum), 'auto' (the fastest fused kernel that covers the call, else XLA),
    'cudnn' / 'splash' (that kernel or an error), 'pallas' (the decode kernels; full sequences as 'auto'),
    'mlra_kernel' (MLRA's absorbed training attention on our kernel, attention.mlra_kernel; here as 'auto').
    In an FP8 train step with delayed scaling, a call that cuDNN's FP8 attention can train runs on it
    (mlra_jax.attention.fp8_attention) under every impl but 'xla' and 'splash'.
    """
    # named for the remat policies that keep the kernel's inputs (dots_attn_kv, dots_attn_qkv: model.REMAT_POLICIES)
    q, k, v = (checkpoint_name(x, name) for x, name in zip((q, k, v), ATTENTION_INPUTS))
    history = fp8_attention.history(q, k, v, impl=impl, masked=mask is not None)
    if history is not None:  # an FP8 train step's attention core on cuDNN's FP8 kernel (delayed scaling)
        _check_shapes(q, k, v)
        record("cudnn_fp8")
        return fp8_attention.fp8_attention(q, k, v, history, scale)
    kernel = choose("auto" if impl in ("pallas", "mlra_kernel") else impl, q, k, v, masked=mask is not None)
    if kernel is not None:
        _check_shapes(q, k, v)
        return kernel(q, k, v, scale=scale)
    if mask is None:
        positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        mask = causal_mask(positions, positions)
    return xla_attention(q, k, v, scale=scale, mask=mask)
