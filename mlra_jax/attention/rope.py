"""Rotary position embedding in the reference's half-split layout (not interleaved)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, width: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape positions.shape + (width // 2,), in float32."""
    if width % 2:
        raise ValueError(f"RoPE width {width} must be even")
    inv_freq = 1.0 / (theta ** (jnp.arange(0, width, 2, dtype=jnp.float32) / width))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate the last axis of x [B, T, ..., D] at positions [B, T].

    With x1 = x[..., :D/2] and x2 = x[..., D/2:]:
    y = concat(x1 cos - x2 sin, x1 sin + x2 cos), computed in float32.
    """
    width = x.shape[-1]
    cos, sin = rope_angles(positions, width, theta)
    extra_axes = x.ndim - positions.ndim - 1  # head axes between T and D
    cos = cos.reshape(cos.shape[:-1] + (1,) * extra_axes + cos.shape[-1:])
    sin = sin.reshape(cos.shape)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : width // 2], x32[..., width // 2 :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.astype(x.dtype)
