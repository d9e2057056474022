"""benchmarks.gpu_clocks: nvidia-smi's samples of the clocks during a benchmark's timed steps."""

import os
import time

from mlra_jax.benchmarks.gpu_clocks import ClockSampler, summarize


def test_samples_are_summarized_over_every_gpu_and_unreadable_lines_skipped():
    lines = [
        "0, 1980, 650.5, 55",
        "1, 1500, 700.0, 61",
        "0, [N/A], 10, 30",
        "No devices were found",
        "",
        "1, 1600, 690, 60",
    ]
    summary = summarize(lines)
    assert summary["samples"] == 3
    assert summary["sm_clock_mhz"] == {"min": 1500.0, "median": 1600.0, "max": 1980.0}
    assert summary["power_w"]["max"] == 700.0 and summary["temperature_c"]["min"] == 55.0
    assert summarize(["[N/A], [N/A]"]) is None


def fake_nvidia_smi(directory, line):
    """An nvidia-smi on PATH that prints `line` for GPUs 0 and 1 every 20 ms until stopped, like `-lms`."""
    script = directory / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nwhile true; do echo "0, {line}"; echo "1, {line}"; sleep 0.02; done\n')
    script.chmod(0o755)
    return f"{directory}{os.pathsep}{os.environ['PATH']}"


def test_the_sampler_reads_nvidia_smi_while_its_block_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, "1545, 698.2, 63"))
    with ClockSampler(interval_ms=20) as clocks:
        time.sleep(0.5)
    assert clocks.summary["samples"] >= 4
    assert clocks.summary["sm_clock_mhz"]["median"] == 1545.0 and clocks.summary["power_w"]["min"] == 698.2


def test_without_nvidia_smi_there_is_no_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with ClockSampler() as clocks:
        pass
    assert clocks.summary is None
