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
