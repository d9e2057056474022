"""MLRA's training attention on our Mosaic GPU kernel, in the model: where it runs, auto's choice, its head groups,
one manual region under a mesh.

The kernel (mlra_jax.pallas_kernels.mlra_attention_gpu_backward's `mlra_attention`: the forward kernel and the
backward's under jax.custom_vjp) computes, per latent block j, causal attention of [q_latent_j || q_rope] over keys
[latent_j || k_rope] and values latent_j, every block sharing one RoPE query. The latent family's absorbed training
attention on one device (attention/latent.py, `absorbed_attention`) is that problem per head group: block
j = c G + g serves the heads of group g (branch c), whose RoPE queries the group's blocks share. So the G groups
are the kernel's `groups` (head g H + i reads block c G + g with its branch c): every model passes its tensors as
they are.

The kernel takes the query side head-major: q_latent [G, H, B, T, C, R] and its output likewise (G head groups of
H heads); W_UK's product batched over the heads writes q_latent so, and W_UV's reads the output so.

`attention_impl="mlra_kernel"` runs that attention on the kernel and is an error (KernelUnavailable) where the
kernel cannot take the call: on Hopper GPUs (compute capability 9.x) in bfloat16 or float16, causal over the whole
sequence (no explicit mask), T == S a multiple of 128, R and Dr multiples of 64, R + Dr <= 192, on one device's
whole layer (no tensor parallelism). `"auto"` takes it for the models with branches (MLRA-2, MLRA-4) where it
runs, and leaves every other call to the fused kernels' choice (attention.fused); latent_form="auto" trains
absorbed exactly where it runs (one H200: the 8-layer MLRA-4 training step 5% faster that way than in the expanded
form on cuDNN's attention, MLRA-2's 2%; docs/performance.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlra_jax.attention.fused import BATCH_AXES, KernelUnavailable, log_once, record
from mlra_jax.platform import target_platform
from mlra_jax.sharding import automatic_axes

MLRA_KERNEL = "mlra_kernel"  # the attention_impl value
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
TOKENS = 128  # the sequence is a multiple of this (two warpgroups of 64 query rows)
WIDTH = 64  # the latent and RoPE widths are multiples of this (one SMEM tile's columns)
MAX_COLUMNS = 192  # R + Dr at most (the backward's accumulators)


def kernel() -> Callable[..., jax.Array]:
    """The kernel, forward and backward: mlra_attention(q_latent, q_rope, latent, k_rope, *, scale, groups)."""
    from mlra_jax.pallas_kernels.mlra_attention_gpu_backward import mlra_attention

    return mlra_attention


def device_problem(dtype: jnp.dtype) -> str | None:
    """Why the kernel cannot run on this backend in this dtype, or None when it can."""
    backend = target_platform()
    if backend != "gpu":
        return f"the MLRA attention kernel runs on NVIDIA Hopper GPUs; the backend is {backend!r}"
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not capability.startswith("9"):
        return f"the MLRA attention kernel needs a Hopper GPU (compute capability 9.x), not {capability or 'unknown'}"
    if dtype not in KERNEL_DTYPES:
        return f"the MLRA attention kernel takes bfloat16 or float16, not {dtype} (set model.compute_dtype=bfloat16)"
    return None


def shape_problem(tokens: int, keys: int, rank: int, rope: int) -> str | None:
    """Why the kernel cannot take these sizes (queries, keys, latent block width R, RoPE width Dr), or None."""
    if tokens != keys or tokens % TOKENS:
        return f"it takes causal self-attention over a multiple of {TOKENS} tokens; got {tokens} queries, {keys} keys"
    if rank % WIDTH or rope % WIDTH or rank + rope > MAX_COLUMNS:
        return (
            f"it takes latent block and RoPE widths in multiples of {WIDTH} with R + Dr <= {MAX_COLUMNS}; "
            f"got R={rank}, Dr={rope}"
        )
    return None


def kernel_problem(queries: jax.Array, latent: jax.Array, k_rope: jax.Array, masked: bool) -> str | None:
    """Why the kernel cannot take this call (queries [B, T, ...], latent [B, S, n, R], k_rope [B, S, ..., Dr];
    masked: under an explicit mask), or None when it can."""
    if masked:
        return "it takes the plain causal mask only (padded or cached attention)"
    problem = device_problem(latent.dtype)
    if problem is None:
        problem = shape_problem(queries.shape[1], latent.shape[1], latent.shape[-1], k_rope.shape[-1])
    return problem


def use_kernel(
    impl: str,
    branches: int,
    queries: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    masked: bool,
    quiet: bool = False,
) -> bool:
    """Whether the absorbed training attention of one device runs on the kernel: always for 'mlra_kernel' (a
    KernelUnavailable naming the reason where it cannot); for 'auto', on a model with
    branches where it can (logged once where it cannot, unless `quiet`); never for the others."""
    if impl == MLRA_KERNEL:
        problem = kernel_problem(queries, latent, k_rope, masked)
        if problem is not None:
            raise KernelUnavailable(
                f"attention_impl='mlra_kernel' cannot run queries {queries.shape} over latent {latent.shape} "
                f"{latent.dtype}: {problem}; use attention_impl='auto', 'cudnn' or 'xla'"
            )
        return True
    if impl != "auto" or branches == 1:
        return False
    problem = kernel_problem(queries, latent, k_rope, masked)
    if problem is not None and not quiet:
        log_once(f"attention_impl='auto': MLRA's absorbed training attention takes the fused kernels ({problem})")
    return problem is None


def tensor_parallel_error() -> KernelUnavailable:
    return KernelUnavailable(
        "attention_impl='mlra_kernel' runs the absorbed training attention on one device's whole layer; under "
        "tensor parallelism (mesh.tensor > 1) use attention_impl='auto' or 'cudnn'"
    )


STORED_DS_BYTES = 8 << 30  # mlra_backward="auto": dS stored where a layer's tiles take at most this on a device


def stored_ds_bytes(batch: int, heads: int, tokens: int, dtype: jnp.dtype) -> int:
    """The bytes of the dS tiles that the stored-dS backward holds for one layer: the causal half's 64 x 64 tiles
    (the diagonal's whole) for every sequence and query head of every branch."""
    tiles = -(-tokens // 64)
    return batch * heads * tiles * (tiles + 1) // 2 * 64 * 64 * jnp.dtype(dtype).itemsize


_WORKSPACES: contextvars.ContextVar[tuple[list[int], ...]] = contextvars.ContextVar("mlra_workspaces", default=())


@contextlib.contextmanager
def backward_workspaces() -> Iterator[list[int]]:
    """Inside: the bytes that the backward of each kernel call traced here holds for the duration of one layer's
    backward beyond its operands (the stored dS tiles; 0 where it recomputes dS), a list entry per call, per device
    (remat="auto" counts them)."""
    spaces: list[int] = []
    token = _WORKSPACES.set((*_WORKSPACES.get(), spaces))
    try:
        yield spaces
    finally:
        _WORKSPACES.reset(token)


def backward_tuning(choice: str, ds_bytes: int) -> str:
    """The kernel's backward tuning for ModelConfig.mlra_backward: "auto" stores dS where it takes at most
    STORED_DS_BYTES."""
    if choice == "auto":
        return "stored_ds" if ds_bytes <= STORED_DS_BYTES else "recomputed_ds"
    return choice


def mlra_kernel_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    k_rope: jax.Array,
    *,
    scale: float,
    backward: str = "auto",
) -> jax.Array:
    """The absorbed training attention on the kernel: q_latent [G, H, B, T, C, R] (G head groups, C branches,
    block c G + g; head-major, as the kernel takes it), q_rope [B, T, G, H, Dr] (each group's), latent
    [B, S, C G, R], k_rope [B, S, Dr] -> [G, H, B, T, C, R]; backward: ModelConfig.mlra_backward. Where mesh axes
    are still automatic, one shard_map makes all of them manual (GSPMD cannot partition a kernel): the batch splits
    over the data axes where it divides, other axes compute redundantly."""
    attend = kernel()
    record(MLRA_KERNEL)

    def run(q_latent, q_rope, latent, k_rope):
        g, h, b, t, c, r = q_latent.shape
        heads_first = q_latent.reshape(g * h, b, t, c, r)  # (free: G and H are adjacent and outermost)
        ds_bytes = stored_ds_bytes(b, g * h * c, t, latent.dtype)
        tuning = backward_tuning(backward, ds_bytes)
        for spaces in _WORKSPACES.get():
            spaces.append(ds_bytes if tuning == "stored_ds" else 0)
        out = attend(heads_first, q_rope.reshape(b, t, g * h, -1), latent, k_rope, scale=scale, groups=g, tuning=tuning)
        return out.reshape(q_latent.shape)

    auto = automatic_axes()
    if not auto:
        return run(q_latent, q_rope, latent, k_rope)
    batch = tuple(a for a in BATCH_AXES if auto.get(a, 1) > 1)
    if batch and q_latent.shape[2] % math.prod(auto[a] for a in batch):
        batch = ()
    queries, rest = P(None, None, batch or None), P(batch or None)
    return jax.shard_map(
        run, in_specs=(queries, rest, rest, rest), out_specs=queries, axis_names=set(auto), check_vma=False
    )(q_latent, q_rope, latent, k_rope)
