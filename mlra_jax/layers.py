"""Building blocks shared by every variant: parameters, RMSNorm, SwiGLU MLP, embedding.

Weights are stored in float32 (`param_dtype`) with the logical axis names that
`sharding.py` maps onto the mesh. As under torch autocast in the reference, the
residual stream and the norms stay in float32 and every matmul runs in the compute
dtype. Kernels are laid out [in..., out...] (y = x @ W), heads on their own axis.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax import fp8, fused_elementwise
from mlra_jax.config import ModelConfig
from mlra_jax.platform import target_platform

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal_init(std: float) -> Initializer:
    return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def zeros_init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)


def ones_init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.ones(shape, dtype)


def xavier_uniform_torch_view(view_shape: tuple[int, ...]) -> Initializer:
    """torch.nn.init.xavier_uniform_ applied to a tensor viewed as `view_shape`.

    torch takes fan_in = view[1] * prod(view[2:]) and fan_out = view[0] * prod(view[2:]);
    the draw is i.i.d. uniform, so only the bound depends on the view.
    """
    receptive = math.prod(view_shape[2:])
    bound = math.sqrt(6.0 / (view_shape[1] * receptive + view_shape[0] * receptive))
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def make_param(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], init: Initializer, cfg: ModelConfig
) -> nnx.Param:
    """A parameter with its logical axis names (one per dimension)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, cfg.weight_dtype), logical_axes=tuple(axes))


def dense_init(cfg: ModelConfig) -> Initializer:
    return normal_init(cfg.init_std)


def output_init(cfg: ModelConfig) -> Initializer:
    """The two output projections: zero (the paper's default) or N(0, init_std)."""
    return zeros_init if cfg.output_init == "zero" else normal_init(cfg.init_std)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as the reference computes it: in float32, cast back to x's dtype, then
    times the (float32) weight, which promotes the result to float32 as torch does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; `shape` may have leading block axes (one norm per block)."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.scale = make_param(rngs, shape, axes, ones_init, cfg)
        self.eps = cfg.norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def einsum(spec: str, *operands: jax.Array, **kwargs) -> jax.Array:
    """jnp.einsum that keeps float32 products in full float32, as torch does by default
    (JAX would otherwise use TF32 on NVIDIA GPUs); lower precisions are unaffected. On GPUs a
    product of one row is computed as two (`two_rows`)."""
    full = any(x.dtype == jnp.float32 for x in operands)
    product = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST if full else None, **kwargs)
    if len(operands) == 2 and target_platform() == "gpu":
        return two_rows(product, spec, *operands)
    return product(spec, *operands)


ROW_COPIES = 2  # rows that a one-row product runs on (two_rows)


def single_row_axes(spec: str, x_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """For einsum(spec, x, w): when every axis that only x and the output have (x's rows) has size 1,
    the first of them in x and in the output; else None."""
    inputs, out = spec.replace(" ", "").split("->")
    x_axes, w_axes = inputs.split(",")
    rows = [i for i, name in enumerate(x_axes) if name in out and name not in w_axes]
    if not rows or any(x_shape[i] != 1 for i in rows):
        return None
    return rows[0], out.index(x_axes[rows[0]])


def two_rows(product: Callable[..., jax.Array], spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """product(spec, x, w) with a single-row x (single_row_axes) computed on two copies of the row and
    sliced back; other products as they are. XLA's GPU compiler rewrites a one-row product whose weight
    has fewer than 10M elements (a decode step at batch 1: every attention projection of a 2.9B model)
    into a multiply and a reduction that reads the weight at about a third of the bandwidth, and for
    some first writes the whole product out (H100: 20 us for a 3072 x 3072 projection, where the weight's
    bytes take 7 us); with two rows it stays a GEMM for cuBLAS. Each row's result is the same product."""
    axes = single_row_axes(spec, x.shape)
    if axes is None:
        return product(spec, x, w)
    x_axis, out_axis = axes
    rows = jnp.broadcast_to(x, x.shape[:x_axis] + (ROW_COPIES,) + x.shape[x_axis + 1 :])  # fuses into the GEMM
    out = product(spec, rows, w)
    return jax.lax.slice_in_dim(out, 0, 1, axis=out_axis)


def row_copies(x: jax.Array) -> jax.Array:
    """On GPUs a single row x [1, 1, ...] as ROW_COPIES copies [ROW_COPIES, 1, ...], for a chain of products that
    runs on the copies as they are and is sliced once at its end; else x. Each product of a single row otherwise
    slices its result back to one row (two_rows), and the next copies it again in front of its GEMM."""
    if target_platform() != "gpu" or x.shape[0] * x.shape[1] != 1:
        return x
    return jnp.broadcast_to(x, (ROW_COPIES,) + x.shape[1:])


def project(x: jax.Array, kernel: nnx.Param, spec: str, dtype: jnp.dtype) -> jax.Array:
    """einsum(spec, x, W) in the compute dtype; as an FP8 matmul inside a train step that asks for one
    (fp8.matmuls), with the amax history of its block's parameter under delayed scaling (fp8.block_histories)."""
    if fp8.active():
        product = fp8.project_param(x, kernel, spec, dtype)
        if product is not None:
            return product
    return einsum(spec, x.astype(dtype), kernel[...].astype(dtype))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); reference c_fc1, c_fc2, c_proj."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.n_embd, cfg.intermediate_size
        self.gate_proj = make_param(rngs, (d, f), ("embed", "mlp"), dense_init(cfg), cfg)
        self.up_proj = make_param(rngs, (d, f), ("embed", "mlp"), dense_init(cfg), cfg)
        self.down_proj = make_param(rngs, (f, d), ("mlp", "embed"), output_init(cfg), cfg)
        self.dtype = cfg.dtype
        self.fused = cfg.fused_elementwise

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, d] -> [B, T, d]. On GPUs one row (B = T = 1) runs through both products as ROW_COPIES rows,
        sliced once at the end (row_copies): the SwiGLU's product feeds the second GEMM as it is. With the row
        sliced out and copied again in front of it (two_rows) that GEMM took 24.1 us instead of 22.0 (H100,
        2.9B at batch 1, per layer)."""
        rows = x.shape[0]
        x = row_copies(x)
        gate = project(x, self.gate_proj, "btd,df->btf", self.dtype)
        up = project(x, self.up_proj, "btd,df->btf", self.dtype)
        if "swiglu" in fused_elementwise.kernels(self.fused):
            product = fused_elementwise.swiglu(gate, up)  # its backward on the kernel
        else:
            product = jax.nn.silu(gate) * up
        return project(product, self.down_proj, "btf,fd->btd", self.dtype)[:rows]


class Embed(nnx.Module):
    """Token embedding, tied with the output head (reference wte / lm_head)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = make_param(rngs, (cfg.vocab_size, cfg.n_embd), ("vocab", "embed"), dense_init(cfg), cfg)
        self.dtype = cfg.dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the tied embedding, accumulated and returned in float32."""
        return einsum(
            "btd,vd->btv",
            x.astype(self.dtype),
            self.embedding[...].astype(self.dtype),
            preferred_element_type=jnp.float32,
        )
