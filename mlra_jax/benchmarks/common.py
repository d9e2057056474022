"""What every benchmark records next to its numbers."""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp


def environment() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "device": devices[0].device_kind,
        "device_count": len(devices),
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        "command": " ".join(
            [
                "python -m "
                + (
                    sys.modules["__main__"].__spec__.name
                    if getattr(sys.modules["__main__"], "__spec__", None)
                    else sys.argv[0]
                )
            ]
            + sys.argv[1:]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def experiment_list(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The experiment names of a comma-separated option; an unknown one is the parser's error (exit 2)."""
    from mlra_jax.experiments import experiment_names

    names = text.split(",")
    unknown = [name for name in names if name not in experiment_names()]
    if unknown:
        parser.error(f"unknown experiment {unknown[0]!r}; valid experiments: {', '.join(experiment_names())}")
    return names


def save(path: Path, benchmark: str, results: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    record = {"benchmark": benchmark, **environment(), **extra, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def earlier_results(
    path: Path,
    remeasured: Callable[[dict[str, Any]], bool],
    run_keys: tuple[str, ...] = ("device", "command", "date", "jax_version"),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """For --merge: the results in the record at `path` that this run does not measure again, the runs
    they came from, and the record itself (all empty when there is no record yet)."""
    if not path.exists():
        return [], [], {}
    record = json.loads(path.read_text())
    kept = [r for r in record["results"] if not remeasured(r)]
    return kept, record.get("runs", [{k: record.get(k) for k in run_keys}]), record


def _filled(paths: list, scale: float, ones: Callable[[tuple], bool]) -> list[jax.Array]:
    """filled_like's leaves, inside a jitted function."""
    keys = jax.random.split(jax.random.key(0), len(paths))
    return [
        jnp.ones(a.shape, a.dtype)
        if ones(path)
        else jnp.broadcast_to((scale * jax.random.normal(key, a.shape[-1:], jnp.float32)).astype(a.dtype), a.shape)
        for key, (path, a) in zip(keys, paths)
    ]


def filled_like(
    tree: Any, shardings: Any = None, scale: float = 1.0, ones: Callable[[tuple], bool] = lambda path: False
) -> Any:
    """Arrays of the tree's shapes and dtypes for timing, made on the device(s) in `shardings`: one random
    row of the last axis (normal, times `scale`) repeated over the others, or ones where ones(key path).
    Drawing every element at random compiles for minutes at the 2.9B models' sizes under a mesh (seen on
    2 x H200: 3 minutes); timings do not depend on the values."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.jit(lambda: treedef.unflatten(_filled(paths, scale, ones)), out_shardings=shardings)()


def refilled(tree: Any, scale: float = 1.0) -> Any:
    """filled_like written into the buffers of `tree` (donated; its arrays are gone after the call), in their
    shardings: a cache that fills most of a device is filled without a second copy of it."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    shardings = jax.tree.map(lambda a: a.sharding, tree)
    fill = jax.jit(
        lambda tree: treedef.unflatten(_filled(paths, scale, lambda path: False)),
        donate_argnums=0,
        keep_unused=True,  # an unused argument would be dropped, and its buffers with the donation
        out_shardings=shardings,
    )
    return fill(tree)


def compiled_memory(compiled: Any) -> dict[str, int]:
    """Bytes per device of a compiled call (XLA's memory analysis): its arguments, outputs, the outputs that
    reuse donated arguments, and its temporaries; empty where the backend gives none."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    return {name.removesuffix("_size_in_bytes") + "_bytes": int(getattr(analysis, name)) for name in fields}


def benchmark_params(cfg: Any, shardings: Any = None) -> dict[str, Any]:
    """Parameters of the model of `cfg` for timing (filled_params) in cfg.param_dtype, in `shardings` when given;
    the model's own initializer compiles for minutes at 2.9B."""
    from flax import nnx

    from mlra_jax.model import abstract_model

    return filled_params(nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param)), shardings)


def filled_params(shapes: Any, shardings: Any = None) -> Any:
    """Parameters of a tree of shapes for timing (filled_like: 0.02 x normal weights, unit norm scales), in
    `shardings` when given."""
    return filled_like(shapes, shardings, scale=0.02, ones=_is_norm_scale)


def _is_norm_scale(path: tuple) -> bool:
    """Whether a parameter's key path ends at a norm's scale."""
    return path[-1] == jax.tree_util.DictKey("scale")


def chained(fn: Callable[..., jax.Array], feed: int, calls: int) -> Callable[..., jax.Array]:
    """fn called `calls` times in one jitted function, each call's output taking the place of argument
    `feed` of the next (same shape and dtype), so that XLA cannot drop the calls and no extra kernel runs
    between them. For calls whose kernels XLA cannot fuse with each other (custom kernels, dots,
    reductions); chained elementwise work fuses into one kernel (seen on the H100), so time it with
    calls=1."""

    def run(*args):
        args = list(args)
        for _ in range(calls):
            out = fn(*args)
            if (out.shape, out.dtype) != (args[feed].shape, args[feed].dtype):
                raise ValueError(
                    f"chained: the output {out.shape} {out.dtype} cannot feed argument {feed} "
                    f"({args[feed].shape} {args[feed].dtype})"
                )
            args[feed] = out
        return args[feed]

    return jax.jit(run)


def device_time(
    fn: Callable[..., jax.Array], args: tuple, repeats: int, feed: int = 0, calls: int = 8
) -> dict[str, Any]:
    """Device seconds per call of fn(*args): on GPUs the profiler's span of `calls` chained calls over
    `calls` (median of `repeats`), which leaves out the host's dispatch, with each kernel's share; elsewhere
    the median wall time of the chain over `calls`."""
    run = chained(fn, feed, calls)
    if jax.default_backend() == "gpu":
        timing = profiled_time(lambda: run(*args), repeats)
        return {
            "time_s": timing["time_s"] / calls,
            "method": f"profiler span of {calls} chained calls / {calls}",
            "kernels_s": {name: seconds / calls for name, seconds in timing["kernels_s"].items()},
        }
    return {
        "time_s": median_time(lambda: run(*args), repeats) / calls,
        "method": f"wall time of {calls} chained calls / {calls}",
    }


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


def profiled_time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> dict[str, Any]:
    """Device time of fn() from the profiler's GPU trace: the median over `repeats` calls of the span from
    the call's first kernel (or copy) start to its last end, the median time of each kernel by name, and the
    ordered kernels of the call at the median span (`timeline`: name, start and duration in us).
    Host dispatch stays out of the number, and so does the host round trip that XLA's GPU while loops
    make every iteration (about 25 us on the lent H100s: timing a jitted fori_loop of calls includes it)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(repeats):
                jax.block_until_ready(fn())
                time.sleep(0.02)  # an idle gap that separates the calls in the trace
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
        planes = jax.profiler.ProfileData.from_file(paths[0]).planes
    events = [
        (event.start_ns, event.end_ns, event.name)
        for plane in planes
        if plane.name.startswith("/device:GPU:0")
        for line in plane.lines
        if line.name.startswith("Stream")
        for event in line.events
    ]
    if not events:
        raise RuntimeError("the profiler recorded no GPU activity (profiled_time needs a GPU)")
    return call_times(split_calls(events, repeats))


def split_calls(
    events: list[tuple[float, float, str]], repeats: int, gap_ns: float = 1e7
) -> list[list[tuple[float, float, str]]]:
    """GPU events (start ns, end ns, name) grouped into the calls they belong to, in order: a call ends where
    `gap_ns` pass without activity (profiled_time sleeps 20 ms between calls). A RuntimeError when the trace
    does not hold `repeats` calls."""
    calls: list[list[tuple[float, float, str]]] = []
    end = 0.0  # the last end of the current call's activity
    for event in sorted(events):
        if not calls or event[0] - end > gap_ns:
            calls.append([])
            end = event[1]
        calls[-1].append(event)
        end = max(end, event[1])
    if len(calls) != repeats:
        raise RuntimeError(f"found {len(calls)} calls in the GPU trace, expected {repeats}")
    return calls


def call_times(calls: list[list[tuple[float, float, str]]]) -> dict[str, Any]:
    """profiled_time's result from the calls' events (split_calls): time_s, kernels_s and timeline."""
    spans = [(max(e for _, e, _ in call) - call[0][0]) * 1e-9 for call in calls]
    per_kernel: dict[str, list[float]] = {}
    for call in calls:
        totals: dict[str, float] = {}
        for start, end, name in call:
            totals[name] = totals.get(name, 0.0) + (end - start) * 1e-9
        for name, seconds in totals.items():
            per_kernel.setdefault(name, []).append(seconds)
    median = sorted(range(len(calls)), key=spans.__getitem__)[len(calls) // 2]
    first = calls[median][0][0]
    return {
        "time_s": statistics.median(spans),
        "kernels_s": {name: statistics.median(times) for name, times in per_kernel.items()},
        "timeline": [
            (name, round((start - first) * 1e-3, 3), round((end - start) * 1e-3, 3))
            for start, end, name in calls[median]
        ],
    }
