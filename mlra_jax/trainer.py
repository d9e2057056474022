"""The training loop: sharded state, grain data, Orbax checkpoints, metrics.

`train(experiment, workdir)` runs or resumes a run in `workdir` (checkpoints/,
metrics.jsonl, tensorboard/, experiment.json); notebooks call it directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mlra_jax.checkpoint import Checkpointer
from mlra_jax.config import ConfigError, Experiment
from mlra_jax.data.pipeline import train_dataset, train_iterator, validation_batches
from mlra_jax.metrics import MetricWriter, format_line, peak_flops, progress_bar, training_flops_per_token
from mlra_jax.model import abstract_model, count_params, init_model
from mlra_jax.optim import learning_rate_schedule, make_optimizer
from mlra_jax.params import logical_axes
from mlra_jax.resume_check import check_resume
from mlra_jax.run_lock import RunLock
from mlra_jax.sharding import (batch_sharding, bytes_per_device, data_parallel_size, make_mesh, replicated,
                               tree_shardings)
from mlra_jax.train_step import loss_fn, make_train_step, micro_batch_sharding

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf; nothing after the last good checkpoint was saved."""


@dataclasses.dataclass
class Setup:
    """Everything about a run that does not depend on the weights' values."""

    experiment: Experiment
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    abstract_state: dict[str, Any]  # ShapeDtypeStructs carrying the target shardings
    state_shardings: dict[str, Any]
    num_params: int
    local_batch: int


def build_setup(experiment: Experiment, devices: list[jax.Device] | None = None) -> Setup:
    mesh = make_mesh(experiment.mesh, devices)
    data_parallel = data_parallel_size(mesh)
    experiment = dataclasses.replace(experiment, train=experiment.train.for_replicas(data_parallel))
    cfg, train = experiment.model, experiment.train
    micro = train.global_batch_size // train.accumulation_steps
    if micro % data_parallel:
        raise ConfigError(f"each micro-batch of {micro} sequences (global_batch_size={train.global_batch_size} / "
                          f"{train.accumulation_steps} accumulation steps) must split evenly over the {data_parallel} "
                          f"data-parallel devices of mesh {dict(mesh.shape)}; adjust train.global_batch_size, "
                          f"train.micro_batch_size or the mesh")
    if train.global_batch_size % jax.process_count():
        raise ConfigError(f"global_batch_size={train.global_batch_size} must split over {jax.process_count()} processes")
    model = abstract_model(cfg)
    graphdef = nnx.split(model)[0]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    param_shardings = tree_shardings(params, logical_axes(model), mesh)
    optimizer = make_optimizer(train)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_shardings = optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, opt_state, param_shardings,
                                                     transform_non_params=lambda _: replicated(mesh))
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    shardings = {"params": param_shardings, "opt_state": opt_shardings, "rng": replicated(mesh)}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            {"params": params, "opt_state": opt_state, "rng": rng}, shardings)
    return Setup(experiment, mesh, graphdef, optimizer, abstract, shardings, count_params(model),
                 train.global_batch_size // jax.process_count())


def init_state(setup: Setup) -> dict[str, Any]:
    """Fresh weights, optimizer state and RNG, created directly in their shardings (never whole on one device)."""
    cfg, seed = setup.experiment.model, setup.experiment.train.seed

    def init() -> dict[str, Any]:
        params = nnx.to_pure_dict(nnx.state(init_model(cfg, seed), nnx.Param))
        return {"params": params, "opt_state": setup.optimizer.init(params),
                "rng": jax.random.key_data(jax.random.key(seed))}

    with jax.set_mesh(setup.mesh):
        return jax.jit(init, out_shardings=setup.state_shardings)()


def memory_estimate(setup: Setup) -> dict[str, int]:
    """Bytes per device: parameters, optimizer state, gradients (as the parameters)."""
    params = bytes_per_device(setup.abstract_state["params"], setup.state_shardings["params"])
    opt = bytes_per_device(setup.abstract_state["opt_state"], setup.state_shardings["opt_state"])
    return {"params": params, "optimizer_state": opt, "gradients": params}


def compiled_memory(setup: Setup) -> dict[str, int] | None:
    """XLA's own per-device accounting of the compiled train step (activations included)."""
    step = jit_train_step(setup)
    tokens = jax.ShapeDtypeStruct((setup.experiment.train.global_batch_size, setup.experiment.train.seq_len + 1),
                                  jnp.int32, sharding=batch_sharding(setup.mesh))
    state = setup.abstract_state
    with jax.set_mesh(setup.mesh):
        analysis = step.lower(state["params"], state["opt_state"], tokens).compile().memory_analysis()
    if analysis is None:
        return None
    return {"arguments": analysis.argument_size_in_bytes, "outputs": analysis.output_size_in_bytes,
            "temporaries": analysis.temp_size_in_bytes, "aliased": analysis.alias_size_in_bytes}


def jit_train_step(setup: Setup):
    """The train step jitted with the state's shardings; params and optimizer state are donated."""
    train = setup.experiment.train
    step = make_train_step(setup.graphdef, setup.optimizer, train.accumulation_steps,
                           micro_batch_sharding(setup.mesh), train.loss_chunk)
    shardings = setup.state_shardings
    return jax.jit(step, in_shardings=(shardings["params"], shardings["opt_state"], batch_sharding(setup.mesh)),
                   out_shardings=(shardings["params"], shardings["opt_state"], replicated(setup.mesh)),
                   donate_argnums=(0, 1))


def global_batch(setup: Setup, local: np.ndarray) -> jax.Array:
    """This process's rows of a batch -> the global array sharded over the data-parallel axes."""
    return jax.make_array_from_process_local_data(batch_sharding(setup.mesh), local)


class _StopSignal:
    """Records SIGTERM (preemption notice) so the loop can checkpoint and exit cleanly."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class TrainResult:
    step: int
    last_loss: float | None
    stopped_by_signal: bool


def train(experiment: Experiment, workdir: Path, devices: list[jax.Device] | None = None,
          allow_changed: tuple[str, ...] = ()) -> TrainResult:
    """Train (or resume) `experiment` in `workdir` until train.total_steps or a stop signal.

    `allow_changed` names the data-order and schedule fields (resume_check.TRAJECTORY_FIELDS) that
    may differ from the run's experiment.json when resuming."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with RunLock(workdir) if jax.process_index() == 0 else contextlib.nullcontext():  # one writer per run
        has_checkpoints = any(p.name.isdigit() for p in (workdir / "checkpoints").glob("*"))
        check_resume(workdir, experiment, has_checkpoints, allow_changed, write=jax.process_index() == 0)
        setup = build_setup(experiment, devices)
        with jax.set_mesh(setup.mesh):  # the model reads the TP degree from the mesh in context
            return _train(setup, workdir)


def _train(setup: Setup, workdir: Path) -> TrainResult:
    experiment = setup.experiment
    train_cfg, cfg = experiment.train, experiment.model
    log.info("%s: %s parameters, mesh %s over %d devices (%s)", experiment.name, f"{setup.num_params:,}",
             dict(setup.mesh.shape), setup.mesh.size, setup.mesh.devices.flat[0].device_kind)

    checkpointer = Checkpointer(workdir / "checkpoints", experiment.checkpoint)
    writer = MetricWriter(workdir, enabled=jax.process_index() == 0)
    restored = checkpointer.restore_latest(setup.abstract_state, required_metadata=("step", "examples"))
    if restored is None:
        step, examples, window, state = 0, 0, [], init_state(setup)
        log.info("initialized a new run in %s", workdir)
    else:
        step, state, metadata = restored
        examples, window = metadata["examples"], metadata.get("log_window", [])
        log.info("resumed from %s at step %d (example %d)", checkpointer.directory / str(step), step, examples)
    writer.truncate_after(step)
    # The data continues at the next unseen example, whatever the batch size now.
    dataset = train_dataset(experiment.data, train_cfg.seq_len, cfg.vocab_size, train_cfg.seed, setup.local_batch,
                            jax.process_index(), jax.process_count(), start_example=examples)
    iterator = train_iterator(dataset, experiment.data)
    val = (validation_batches(experiment.data, train_cfg.seq_len, cfg.vocab_size, setup.local_batch,
                              train_cfg.eval_batches, jax.process_index(), jax.process_count())
           if train_cfg.eval_every else [])

    train_step = jit_train_step(setup)
    eval_step = jax.jit(lambda p, t: loss_fn(setup.graphdef, p, t, train_cfg.loss_chunk),
                        in_shardings=(setup.state_shardings["params"], batch_sharding(setup.mesh)))
    schedule = learning_rate_schedule(train_cfg)
    tokens_per_step = train_cfg.global_batch_size * train_cfg.seq_len
    flops_per_token = training_flops_per_token(cfg, train_cfg.seq_len)
    peak = peak_flops(setup.mesh.devices.flat[0])
    stop = _StopSignal()
    bar = progress_bar(train_cfg.total_steps, step) if jax.process_index() == 0 else None
    pending: list[tuple[int, dict[str, jax.Array]]] = []  # device metrics not yet checked
    # Checked metrics since the last log line; saved with each checkpoint, so resumed averages equal
    # uninterrupted ones. Throughput counts only the steps this process timed.
    interval: list[dict[str, float]] = window
    timed, interval_start, paused, last_loss = 0, time.perf_counter(), 0.0, None

    def check_pending() -> None:
        """Fetch the pending steps' metrics; a non-finite loss stops the run before anything is saved."""
        for s, metrics in pending:
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not (math.isfinite(values["loss"]) and values["finite"]):
                good = checkpointer.steps()
                parameters = "finite" if values["params_finite"] else "NOT finite"
                raise TrainingDiverged(
                    f"loss is {values['loss']} at step {s} (gradient norm {values['grad_norm']}, updated parameters "
                    f"{parameters}); training stopped and nothing from this point was saved. The last finite step "
                    f"is {s - 1}; the last good checkpoint is "
                    f"{checkpointer.directory / str(good[-1]) if good else 'none'}; lower train.peak_lr or check "
                    f"the data, then resume")
            interval.append({"loss": values["loss"], "grad_norm": values["grad_norm"]})
        pending.clear()

    def save(at_step: int) -> None:
        nonlocal paused
        start = time.perf_counter()
        check_pending()
        checkpointer.save(at_step, state, {"step": at_step, "examples": examples, "log_window": list(interval),
                                           "experiment": experiment.name})
        paused += time.perf_counter() - start

    try:
        while step < train_cfg.total_steps:
            if stop.received is not None or checkpointer.reached_preemption(step):
                log.warning("stop signal received: saving a checkpoint at step %d and exiting", step)
                save(step)
                checkpointer.wait()
                return TrainResult(step, last_loss, stopped_by_signal=True)
            batch = global_batch(setup, next(iterator))
            state["params"], state["opt_state"], metrics = train_step(state["params"], state["opt_state"], batch)
            step, examples, timed = step + 1, examples + train_cfg.global_batch_size, timed + 1
            pending.append((step, metrics))
            if bar is not None:
                bar.update(1)
            record: dict[str, Any] = {}
            if step % train_cfg.log_every == 0 or step == train_cfg.total_steps:
                check_pending()
                elapsed = time.perf_counter() - interval_start - paused
                tokens_per_s = timed * tokens_per_step / elapsed
                last_loss = interval[-1]["loss"]
                record.update(loss=float(np.mean([m["loss"] for m in interval])),
                              grad_norm=interval[-1]["grad_norm"], lr=float(schedule(step - 1)),
                              tokens_per_s=tokens_per_s, step_time_s=elapsed / timed,
                              mfu=flops_per_token * tokens_per_s / (peak * setup.mesh.size) if peak else None)
                interval.clear()
                timed, interval_start, paused = 0, time.perf_counter(), 0.0
            if val and train_cfg.eval_every and (step % train_cfg.eval_every == 0 or step == train_cfg.total_steps):
                start = time.perf_counter()
                losses = [eval_step(state["params"], global_batch(setup, b)) for b in val]
                record["val_loss"] = float(np.mean(jax.device_get(losses)))
                paused += time.perf_counter() - start
            if record and jax.process_index() == 0:
                writer.write(step, record)
                message = format_line(step, train_cfg.total_steps, record)
                bar.write(message) if bar is not None else log.info(message)
            if step % experiment.checkpoint.every == 0 or step == train_cfg.total_steps:
                save(step)
        check_pending()
        return TrainResult(step, last_loss, stopped_by_signal=False)
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
        checkpointer.close()
        writer.close()
