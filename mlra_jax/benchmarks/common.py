"""What every benchmark records next to its numbers."""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp


def environment() -> dict[str, Any]:
    devices = jax.devices()
    return {"device": devices[0].device_kind, "device_count": len(devices), "backend": jax.default_backend(),
            "jax_version": jax.__version__, "python": platform.python_version(),
            "command": " ".join(["python -m " + (sys.modules["__main__"].__spec__.name
                                                 if getattr(sys.modules["__main__"], "__spec__", None)
                                                 else sys.argv[0])] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def save(path: Path, benchmark: str, results: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    record = {"benchmark": benchmark, **environment(), **extra, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def device_loop_time(fn: Callable[..., jax.Array], args: tuple, repeats: int, iterations: int = 16) -> float:
    """Median seconds per call of fn(*args) with `iterations` chained calls in one jitted loop, so the
    host's dispatch and synchronization (about 0.1 ms on the lent VMs) stay out of the number.
    Each call's first argument depends on the previous output (times zero) so none is skipped."""

    def looped(*args):
        def body(_, first):
            out = fn(first, *args[1:])
            return first + (jnp.ravel(out)[0] * 0).astype(first.dtype)

        return jax.lax.fori_loop(0, iterations, body, args[0])

    looped = jax.jit(looped)
    return median_time(lambda: looped(*args), repeats) / iterations


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn() in seconds, blocking on its outputs, after warm-up calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
