"""The GPUs' SM clock, power draw and temperature, sampled by nvidia-smi while a benchmark times its steps.

An H100 SXM capped at 700 W holds about 1.98 GHz for the first seconds of a heavy load and settles near
1.5-1.6 GHz once hot, so the same training step runs up to about 11% slower in sustained training than
on a cool GPU. A benchmark records the clocks its timed steps ran at beside its numbers.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from types import TracebackType
from typing import Any

QUERY = "index,clocks.sm,power.draw,temperature.gpu"
FIELDS = ("sm_clock_mhz", "power_w", "temperature_c")


def summarize(lines: list[str]) -> dict[str, Any] | None:
    """Min, median and max of each field over nvidia-smi's `QUERY` lines (CSV, no header or units) from every
    GPU; lines that are not numbers ('[N/A]', messages) are skipped. None when no line was read."""
    samples: dict[str, list[float]] = {field: [] for field in FIELDS}
    count = 0
    for line in lines:
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 1 + len(FIELDS):
            continue
        try:
            values = [float(part) for part in parts[1:]]
        except ValueError:
            continue
        count += 1
        for field, value in zip(FIELDS, values):
            samples[field].append(value)
    if not count:
        return None
    stats = lambda v: {"min": min(v), "median": statistics.median(v), "max": max(v)}
    return {"samples": count, **{field: stats(values) for field, values in samples.items()}}


class ClockSampler:
    """`with ClockSampler() as clocks: ...` samples every GPU each `interval_ms` during the block;
    `clocks.summary` is then summarize()'s result (None without nvidia-smi or when it read nothing)."""

    def __init__(self, interval_ms: int = 500):
        self.interval_ms = interval_ms
        self.summary: dict[str, Any] | None = None
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> ClockSampler:
        command = shutil.which("nvidia-smi")
        if command:
            self._process = subprocess.Popen(
                [command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            output, _ = self._process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            output, _ = self._process.communicate()
        self.summary = summarize(output.splitlines())
