"""The training loop: resume, step, log, evaluate, checkpoint, stop.

`train(experiment, workdir)` runs or resumes a run in `workdir` (checkpoints/, metrics.jsonl,
tensorboard/, experiment.json); notebooks call it directly. `TrainingLoop` holds one run's
moving parts; each concern is one method (`step`, `log`, `evaluate`, `save`), so a subclass
can extend one without touching the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np
from etils import epath

from mlra_jax import fp8
from mlra_jax.checkpoint import Checkpointer
from mlra_jax.config import Experiment
from mlra_jax.data.pipeline import (
    check_data,
    check_token_ids,
    data_fingerprint,
    eval_windows,
    train_dataset,
    train_iterator,
    validation_batches,
)
from mlra_jax.guards import check_finite, check_run_dir, remove_stale_temporaries
from mlra_jax.metrics import MetricWriter, format_line, peak_flops, training_flops_per_token
from mlra_jax.optim import learning_rate_schedule
from mlra_jax.paths import as_path, is_remote
from mlra_jax.progress import progress_bar, show_library_logs
from mlra_jax.sharding import batch_sharding
from mlra_jax.tracking import WandbTracker, check_available
from mlra_jax.training.init_from import check_same_model, source_params
from mlra_jax.training.profile import StepProfiler
from mlra_jax.training.resume_check import check_resume, record_experiment
from mlra_jax.training.run_lock import RunLock
from mlra_jax.training.state import (
    Setup,
    build_setup,
    fresh_fp8_histories,
    global_batch,
    init_state,
    jit_train_step,
    state_from_params,
)
from mlra_jax.training.step import loss_fn

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf; nothing after the last good checkpoint was saved."""


@dataclasses.dataclass
class TrainResult:
    step: int
    last_loss: float | None  # the loss of the last step line (its mean over the steps since the line before)
    stopped_by_signal: bool


class _StopSignal:
    """Records SIGTERM (preemption notice) and a first Ctrl-C (SIGINT) so the loop can checkpoint and exit cleanly;
    a second Ctrl-C aborts at once (KeyboardInterrupt, nothing more saved). Only in a single-process run: with
    several processes, JAX's preemption notifier keeps SIGTERM and the processes agree on the step to stop at
    (`Checkpointer.reached_preemption`), where a flag per process could stop them at different steps."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        if signum == signal.SIGINT:
            log.warning("Ctrl-C: saving a checkpoint after this step, then exiting (Ctrl-C again aborts without it)")

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


class TrainingLoop:
    """One run: restores the newest checkpoint (or initializes), then `run()` trains to total_steps."""

    def __init__(self, setup: Setup, workdir: epath.Path, init_from: str | os.PathLike | None = None):
        self.init_from = init_from
        self.setup, self.experiment = setup, setup.experiment
        self.cfg, self.train_cfg = setup.experiment.model, setup.experiment.train
        self.is_writer = jax.process_index() == 0
        self.checkpointer = Checkpointer(workdir / "checkpoints", self.experiment.checkpoint)
        try:
            self._start(setup, workdir)
        except BaseException:
            self.checkpointer.close()  # its threads would otherwise fail at exit over the real error
            raise

    def _start(self, setup: Setup, workdir: epath.Path) -> None:
        self._restore(workdir)
        tracked = self.is_writer and self.experiment.metrics.wandb_project
        self.writer = MetricWriter(
            workdir, enabled=self.is_writer, tracker=WandbTracker(self.experiment, workdir) if tracked else None
        )
        self.writer.truncate_after(self.step)
        self.profiler = StepProfiler(self.experiment.profile, workdir, self.step)
        train_cfg, data = self.train_cfg, self.experiment.data
        # The data continues at the next unseen example, whatever the batch size now.
        dataset = train_dataset(
            data,
            train_cfg.seq_len,
            self.cfg.vocab_size,
            train_cfg.seed,
            setup.local_batch,
            jax.process_index(),
            jax.process_count(),
            start_example=self.examples,
        )
        self.iterator = train_iterator(dataset, data)
        self.val = (
            validation_batches(
                data,
                train_cfg.seq_len,
                self.cfg.vocab_size,
                setup.local_batch,
                train_cfg.eval_batches,
                jax.process_index(),
                jax.process_count(),
            )
            if train_cfg.eval_every
            else []
        )
        self.eval_sets = {name: self._eval_set_batches(path) for name, path in train_cfg.named_eval_sets.items()}
        self.train_step = jit_train_step(setup)
        self.eval_step = jax.jit(
            lambda p, t: loss_fn(setup.graphdef, p, t, train_cfg.loss_chunk),
            in_shardings=(setup.state_shardings["params"], batch_sharding(setup.mesh)),
        )
        self.schedule = learning_rate_schedule(train_cfg)
        self.flops_per_token = training_flops_per_token(self.cfg, train_cfg.seq_len)
        self.peak = peak_flops(setup.mesh.devices.flat[0])
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []  # device metrics not yet checked
        self.timed, self.interval_start, self.paused, self.last_loss = 0, time.perf_counter(), 0.0, None

    def _restore(self, workdir: epath.Path) -> None:
        restored = self.checkpointer.restore_latest(
            self.setup.abstract_state,
            required_metadata=("step", "examples"),
            validate=lambda step, state: check_finite(state["params"], f"checkpoint {step}"),
        )
        # `window`: checked metrics since the last log line, saved with each checkpoint so that resumed
        # averages equal uninterrupted ones.
        if restored is None:
            self.step, self.examples, self.window, self.saved_step = 0, 0, [], None
            if self.init_from is None:
                self.state = init_state(self.setup)
                log.info("initialized a new run in %s", workdir)
                return
            params, step = source_params(self.init_from, self.setup.abstract_state["params"])
            self.state = state_from_params(self.setup, params)
            log.info(
                "started a new run in %s from the weights of %s (step %d); fresh optimizer state",
                workdir,
                self.init_from,
                step,
            )
            return
        self.step, self.state, metadata = restored
        if "fp8" not in self.state:  # saved without FP8 histories or in another layout (Checkpointer.restore_step)
            self.state["fp8"] = fresh_fp8_histories(self.setup)
            if jax.tree.leaves(self.state["fp8"]):
                log.info("model.matmul_dtype=float8 with delayed scaling: step %d starts fresh FP8 scales", self.step)
        elif fp8.history_names(self.state["fp8"]) != fp8.history_names(self.setup.abstract_state["fp8"]):
            # some sites' histories only (saved before others had one): the others start fresh
            self.state["fp8"], fresh = fp8.completed_histories(self.state["fp8"], fresh_fp8_histories(self.setup))
            log.info("step %d starts fresh FP8 scales for %s", self.step, ", ".join(fresh))
        damaged = fp8.damaged_histories(self.state["fp8"])
        if damaged:  # an infinite amax would give an infinite scale: those projections start fresh scales
            self.state["fp8"] = fp8.reset_histories(self.state["fp8"], damaged)
            log.warning(
                "the FP8 amax histories of %s in checkpoint %d hold NaN, inf, negative or huge values; they start "
                "fresh (scale 1 for a step)",
                ", ".join(damaged[:8]) + (f" and {len(damaged) - 8} more" if len(damaged) > 8 else ""),
                self.step,
            )
        self.saved_step = self.step
        self.examples, self.window = metadata["examples"], metadata.get("log_window", [])
        log.info(
            "resumed from %s at step %d (example %d)",
            self.checkpointer.directory / str(self.step),
            self.step,
            self.examples,
        )

    def _eval_set_batches(self, path: str) -> list[np.ndarray]:
        """This process's rows of the first eval_batches global batches of a held-out file's windows."""
        size, seq_len, processes = self.train_cfg.global_batch_size, self.train_cfg.seq_len, jax.process_count()
        windows = eval_windows(path, seq_len, self.train_cfg.eval_batches * size * seq_len, size)
        check_token_ids(windows, path, self.cfg.vocab_size, seq_len, jax.process_index(), jax.process_count())
        return [windows[i : i + size][jax.process_index() :: processes] for i in range(0, len(windows), size)]

    def run(self) -> TrainResult:
        stop = _StopSignal()
        bar, compiled = None, False
        try:
            while self.step < self.train_cfg.total_steps:
                if stop.received is not None or self.checkpointer.reached_preemption(self.step):
                    log.warning("stop signal received: saving a checkpoint at step %d and exiting", self.step)
                    self.save()
                    self.checkpointer.wait()
                    return TrainResult(self.step, self.last_loss, stopped_by_signal=True)
                self.profiler.before_step(self.step + 1)
                if not compiled:  # the first call compiles (or loads from the compilation cache), then dispatches
                    log.info("compiling the train step...")
                    start = time.perf_counter()
                self.train_one_step()
                if not compiled:
                    log.info("compiled the train step in %.1f s", time.perf_counter() - start)
                    compiled = True
                    bar = progress_bar(self.train_cfg.total_steps, self.step - 1) if self.is_writer else None
                self.paused += self.profiler.after_step(self.step, self.state["params"])  # writing the trace
                if bar is not None:
                    bar.update(1)
                record = {**self.log_values(), **self.evaluate()}
                if record and self.is_writer:
                    self.writer.write(self.step, record)
                    message = format_line(self.step, self.train_cfg.total_steps, record)
                    bar.write(message) if bar is not None else log.info(message)
                    if bar is not None and "loss" in record:
                        bar.set_postfix_str(f"loss {record['loss']:.3f}, {record['tokens_per_s']:,.0f} tokens/s")
                if self._due(self.experiment.checkpoint.every):
                    self.save()
            self.check_pending()
            return TrainResult(self.step, self.last_loss, stopped_by_signal=False)
        finally:
            self.profiler.stop()  # a run that ends (or fails) inside the traced steps
            stop.restore()
            if bar is not None:
                bar.close()
            self.checkpointer.close()
            self.writer.close()

    def _due(self, every: int) -> bool:
        return self.step % every == 0 or self.step == self.train_cfg.total_steps

    def train_one_step(self) -> None:
        """Dispatch one optimizer step (asynchronously: its metrics are checked later)."""
        batch = global_batch(self.setup, next(self.iterator))
        state = self.state
        state["params"], state["opt_state"], state["fp8"], metrics = self.train_step(
            state["params"], state["opt_state"], state["fp8"], batch
        )
        self.step, self.examples, self.timed = (
            self.step + 1,
            self.examples + self.train_cfg.global_batch_size,
            self.timed + 1,
        )
        self.pending.append((self.step, metrics))

    def check_pending(self) -> None:
        """Fetch the pending steps' metrics; a non-finite one stops the run before anything is saved."""
        for step, metrics in self.pending:
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not (math.isfinite(values["loss"]) and values["finite"]):
                good = self.checkpointer.steps()
                parameters = "finite" if values["params_finite"] else "NOT finite"
                raise TrainingDiverged(
                    f"loss is {values['loss']} at step {step} (gradient norm {values['grad_norm']}, updated "
                    f"parameters {parameters}); training stopped and nothing from this point was saved. The last "
                    f"finite step is {step - 1}; the last good checkpoint is "
                    f"{self.checkpointer.directory / str(good[-1]) if good else 'none'}; lower train.peak_lr or "
                    f"check the data, then resume"
                )
            self.window.append({"loss": values["loss"], "grad_norm": values["grad_norm"]})
        self.pending.clear()

    def log_values(self) -> dict[str, Any]:
        """The averaged metrics of the steps since the last line, when a line is due; else {}.
        Throughput counts only the steps this process timed."""
        if not self._due(self.train_cfg.log_every):
            return {}
        self.check_pending()
        elapsed = time.perf_counter() - self.interval_start - self.paused
        tokens_per_s = self.timed * self.train_cfg.global_batch_size * self.train_cfg.seq_len / elapsed
        self.last_loss = float(np.mean([m["loss"] for m in self.window]))  # the line's loss, reported at the end
        record = dict(
            loss=self.last_loss,
            grad_norm=self.window[-1]["grad_norm"],
            lr=float(self.schedule(self.step - 1)),
            tokens_per_s=tokens_per_s,
            step_time_s=elapsed / self.timed,
            mfu=(self.flops_per_token * tokens_per_s / (self.peak * self.setup.mesh.size) if self.peak else None),
        )
        self.window.clear()
        self.timed, self.interval_start, self.paused = 0, time.perf_counter(), 0.0
        return record

    def evaluate(self) -> dict[str, float]:
        """The validation loss and the held-out sets' losses and perplexities, when due; else {}. Their
        time is not counted as training time."""
        if not ((self.val or self.eval_sets) and self.train_cfg.eval_every and self._due(self.train_cfg.eval_every)):
            return {}
        start, record = time.perf_counter(), {}
        if self.val:
            record["val_loss"] = self._mean_loss(self.val)
        for name, batches in self.eval_sets.items():
            loss = self._mean_loss(batches)
            record[f"val/{name}/loss"], record[f"val/{name}/ppl"] = loss, math.exp(loss)
        self.paused += time.perf_counter() - start
        return record

    def _mean_loss(self, batches: list[np.ndarray]) -> float:
        losses = [self.eval_step(self.state["params"], global_batch(self.setup, b)) for b in batches]
        return float(np.mean(jax.device_get(losses)))

    def save(self) -> None:
        """Check the pending steps, then start an (asynchronous) checkpoint of the current step, unless
        it is saved already (a stop signal right after a periodic save)."""
        if self.saved_step == self.step:
            return
        start = time.perf_counter()
        self.check_pending()
        self.saved_step = self.step
        self.checkpointer.save(
            self.step,
            self.state,
            {
                "step": self.step,
                "examples": self.examples,
                "log_window": list(self.window),
                "experiment": self.experiment.name,
            },
        )
        self.writer.flush()  # on an object store the metrics up to this checkpoint are in memory only
        self.paused += time.perf_counter() - start


def train(
    experiment: Experiment,
    workdir: str | os.PathLike,
    devices: list[jax.Device] | None = None,
    allow_changed: tuple[str, ...] = (),
    init_from: str | os.PathLike | None = None,
) -> TrainResult:
    """Train (or resume) `experiment` in `workdir` until train.total_steps or a stop signal.

    `allow_changed` names the data-order and schedule fields (resume_check.TRAJECTORY_FIELDS) that
    may differ from the run's experiment.json when resuming. `workdir` is a local folder or a URL
    (gs://bucket/run: checkpoints, metrics and TensorBoard logs go there; no run lock). `init_from`, a run
    directory or a Hugging Face folder of `convert to-hf`, gives a new run its weights (fresh optimizer state,
    step 0); a run that has checkpoints resumes from them instead."""
    show_library_logs()  # the step lines appear also when train() is called from a notebook or a script
    workdir = as_path(workdir)
    check_available(experiment)  # before anything is written
    if init_from is not None:
        check_same_model(init_from, experiment.model)
    made = not is_remote(workdir) and not os.path.isdir(workdir)  # a refused start removes the folder it made
    check_run_dir(workdir)
    lock = RunLock(workdir) if jax.process_index() == 0 else None  # one writer per run
    started = False
    try:
        log.info(
            "%s",
            check_data(
                experiment.data,
                experiment.train.seq_len,
                experiment.train.eval_every > 0,
                experiment.train.named_eval_sets,
            ),
        )  # before the state is built
        if lock is not None:
            lock.acquire()
            _remove_stale_temporaries(workdir)
        has_checkpoints = any(p.name.isdigit() for p in (workdir / "checkpoints").glob("*"))
        fingerprint = data_fingerprint(experiment.data)
        check_resume(workdir, experiment, has_checkpoints, allow_changed, fingerprint)
        setup = build_setup(experiment, devices)
        with jax.set_mesh(setup.mesh):  # the model reads the TP degree from the mesh in context
            log.info(
                "%s: %s parameters, mesh %s over %d devices (%s)",
                setup.experiment.name,
                f"{setup.num_params:,}",
                dict(setup.mesh.shape),
                setup.mesh.size,
                setup.mesh.devices.flat[0].device_kind,
            )
            loop = TrainingLoop(setup, workdir, None if has_checkpoints else init_from)
            if jax.process_index() == 0:  # the run started: its record now says what it is
                record_experiment(workdir, experiment, fingerprint)
            started = True
            return loop.run()
    finally:
        if lock is not None:
            lock.release(started=started)
        if made and not started:
            with contextlib.suppress(OSError):
                os.rmdir(workdir)  # only when empty: nothing of a refused start stays


def _remove_stale_temporaries(workdir: epath.Path) -> None:
    """The temporaries that a killed rewrite of the run's own files left (the run lock is held: no writer is
    mid-write)."""
    if is_remote(workdir):
        return
    removed = remove_stale_temporaries(workdir, ("metrics.jsonl", "experiment.json"))
    if removed:
        log.info("removed the temporaries of killed rewrites in %s: %s", workdir, ", ".join(removed))
