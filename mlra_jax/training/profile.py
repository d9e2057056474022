"""A JAX profiler trace of chosen training steps (--profile.start_step, --profile.steps) into RUN/profile.

The trace is the profiler's own format (RUN/profile/plugins/profile/DATE/HOST.xplane.pb, which TensorBoard's
profile plugin opens: `tensorboard --logdir RUN/profile`) plus, on a local workdir, perfetto_trace.json.gz
beside it for https://ui.perfetto.dev. Every process traces its own devices.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
from etils import epath

from mlra_jax.config import ProfileConfig
from mlra_jax.paths import is_remote

log = logging.getLogger(__name__)


class StepProfiler:
    """Starts the trace before step `start_step` and stops it after step `start_step + steps - 1` (or when
    the run ends first). A run resumed past `start_step` is not traced."""

    def __init__(self, cfg: ProfileConfig, workdir: epath.Path, first_step: int):
        self.directory = workdir / "profile"
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.active = False
        if cfg.steps and first_step >= self.first:
            log.warning(
                "not tracing: --profile.start_step=%d is at or before the step this run resumes from "
                "(%d); choose a later step",
                self.first,
                first_step,
            )

    def before_step(self, step: int) -> None:
        """Called before optimizer step `step` (counting from 1) is dispatched."""
        if step == self.first and self.last >= self.first:
            jax.profiler.start_trace(os.fspath(self.directory), create_perfetto_trace=not is_remote(self.directory))
            self.active = True
            log.info("profiling steps %d-%d into %s", self.first, self.last, self.directory)

    def after_step(self, step: int, outputs: Any) -> float:
        """Called after step `step` was dispatched; after the last traced step, waits for `outputs` and
        writes the trace. Returns the seconds spent writing it (0.0 otherwise): not training time."""
        if self.active and step >= self.last:
            return self.stop(outputs)
        return 0.0

    def stop(self, outputs: Any = None) -> float:
        """Write the trace if one is running (after `outputs` are computed); the seconds spent writing it."""
        if not self.active:
            return 0.0
        jax.block_until_ready(outputs)
        start = time.perf_counter()
        jax.profiler.stop_trace()
        self.active = False
        log.info(
            "profiler trace written to %s (tensorboard --logdir %s, or perfetto_trace.json.gz in "
            "https://ui.perfetto.dev)",
            self.directory,
            self.directory,
        )
        return time.perf_counter() - start
