"""The floor of a decode step on each device, from what the step must read and compute there.

A decode step reads every weight its device holds once (the embedding table only for the batch's rows), the cached
tokens of its sequences once, and does two FLOPs per weight element and row plus the attention's FLOPs over the
context. At the device's ceilings, measured in the same process (`measured_ceilings`: a device-to-device copy, bytes
read plus written; a large bf16 matrix product), the floor is the larger of bytes / bandwidth and FLOPs / peak.
Collectives move data between devices, not through memory: their count and bytes (from the compiled step,
`collective_census`) are recorded beside the floor, not added to it.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from mlra_jax.benchmarks.common import device_time
from mlra_jax.cache_accounting import decode_shape
from mlra_jax.config import ModelConfig
from mlra_jax.decode import region_block

_COLLECTIVE = re.compile(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_ARRAY = re.compile(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "bf16": 2}


def copy_bandwidth(gigabytes: float) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), timed like the kernels."""
    n = int(gigabytes * 2**30 / 2)
    x = jnp.full((n,), 1.5, jnp.bfloat16)
    seconds = device_time(lambda a: a + jnp.bfloat16(1), (x,), repeats=10, calls=1)["time_s"]
    return 2 * n * 2 / seconds


def matmul_rate(size: int = 8192) -> float:
    """bf16 matrix-product FLOPs/s of one [size, size] x [size, size] product (random operands), timed like the
    kernels."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16) / math.sqrt(size)
    seconds = device_time(lambda x, w: x @ w, (a, b), repeats=5, calls=4)["time_s"]
    return 2 * size**3 / seconds


def measured_ceilings(copy_gb: float = 2.0, matmul_size: int = 8192) -> dict[str, float]:
    """This device's copy bandwidth and bf16 matrix rate, measured now (on CPUs with a copy of at most 64 MiB and a
    product of at most 512 x 512 x 512: the ceilings there only scale the record's floors)."""
    if jax.default_backend() == "cpu":
        copy_gb, matmul_size = min(copy_gb, 1 / 16), min(matmul_size, 512)
    return {"copy_bandwidth_bytes_per_s": copy_bandwidth(copy_gb), "bf16_flops_per_s": matmul_rate(matmul_size)}


def _array_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        size = _ITEMSIZE.get(dtype, int(dtype[1:]) // 8 if dtype[1:].isdigit() else 4)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collective_census(hlo: str) -> dict[str, Any]:
    """The collectives of a compiled (SPMD-partitioned) module's text, per device: their count by kind and the bytes
    of their results."""
    counts: dict[str, int] = {}
    moved = 0
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            counts[match.group(2)] = counts.get(match.group(2), 0) + 1
            shape = match.group(1)
            if match.group(3) and shape.startswith("(("):  # an async start: ((operands), results)
                shape = shape[shape.index(")") + 1 :]
            moved += _array_bytes(shape)
    return {"collectives": counts, "collective_bytes": moved}


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of (sharded) arrays: the largest shard of each."""
    return sum(max(s.data.nbytes for s in a.addressable_shards) for a in jax.tree.leaves(tree))


def shard_elements(tree: Any) -> int:
    """Elements one device holds of a tree of (sharded) arrays."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(tree))


def attention_flops_per_token(cfg: ModelConfig, tp: int) -> float:
    """Decode attention FLOPs per cached token, layer and sequence on one of `tp` devices (the absorbed form for the
    latent family): the variant's total over its heads, split over the devices."""
    shape = decode_shape(cfg)
    return shape.flops_per_token * shape.tp / tp


def cache_bytes_in_use(caches: Any, context: int, slot_axis: int = 1) -> int:
    """Bytes one device reads of caches whose `slot_axis` holds the slots (per-layer caches [B, capacity, ...]: 1)
    when `context` tokens per sequence are cached."""
    total = 0
    for a in jax.tree.leaves(caches):
        total += max(s.data.nbytes for s in a.addressable_shards) * context // a.shape[slot_axis]
    return total


def floor(
    weight_bytes: int, cache_bytes: int, flops: float, ceilings: dict[str, float], step_time_s: float
) -> dict[str, Any]:
    """The floor of a step that reads these bytes and does these FLOPs on one device, and the step against it."""
    memory_s = (weight_bytes + cache_bytes) / ceilings["copy_bandwidth_bytes_per_s"]
    compute_s = flops / ceilings["bf16_flops_per_s"]
    floor_s = max(memory_s, compute_s)
    return {
        "weight_bytes": int(weight_bytes),
        "cache_bytes": int(cache_bytes),
        "flops": float(flops),
        "memory_floor_s": memory_s,
        "compute_floor_s": compute_s,
        "floor_time_s": floor_s,
        "bound": "memory" if memory_s >= compute_s else "compute",
        "time_over_floor": step_time_s / floor_s,
        **ceilings,
    }


def matrix_elements(tree: Any) -> int:
    """Elements one device holds of the weights in `tree` that multiply (every leaf outside a norm)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sum(
        math.prod(a.sharding.shard_shape(a.shape))
        for path, a in leaves
        if not any("norm" in str(getattr(key, "key", "")) for key in path)
    )


def model_step_floor(
    cfg: ModelConfig, weights: dict[str, Any], layers: Any, tp: int, local_rows: int, context: int
) -> tuple[int, int, float]:
    """(weight bytes, cache bytes, FLOPs) one device must read and do in a whole-model decode step on the serving
    path: its shards of the serving weights (the embedding table only for its `local_rows` rows), its caches'
    `context` tokens, two FLOPs per matrix element and row and the attention over the context."""
    embedding = weights["embed"]["embedding"]
    others = region_block.decode_read({k: v for k, v in weights.items() if k != "embed"})
    weight_bytes = shard_bytes(others) + local_rows * embedding.shape[1] * embedding.dtype.itemsize
    attention = cfg.n_layer * local_rows * context * attention_flops_per_token(cfg, tp)
    return weight_bytes, cache_bytes_in_use(layers, context), 2 * matrix_elements(others) * local_rows + attention


def kernel_sum(kernels_s: dict[str, float]) -> float:
    """The sum of a step's kernel times (overlapping kernels count each)."""
    return float(sum(kernels_s.values()))
