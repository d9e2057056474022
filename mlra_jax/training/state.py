"""A run's sharded state: the mesh, the abstract state with its shardings, fresh initialization, the
jitted train step and per-device memory. Nothing here depends on the weights' values."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mlra_jax.config import ConfigError, Experiment
from mlra_jax.model import abstract_model, count_params, fp8_histories, init_model
from mlra_jax.optim import make_optimizer
from mlra_jax.params import logical_axes
from mlra_jax.sharding import (
    batch_sharding,
    bytes_per_device,
    data_parallel_size,
    make_mesh,
    replicated,
    tree_shardings,
    without_axis,
)
from mlra_jax.training.remat_choice import resolve_remat
from mlra_jax.training.step import make_train_step, micro_batch_sharding


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
    capped = experiment.train.micro_batch_size is None and experiment.train.max_micro_batch_per_device is not None
    experiment = dataclasses.replace(experiment, train=experiment.train.for_replicas(data_parallel))
    cfg, train = experiment.model, experiment.train
    micro = train.global_batch_size // train.accumulation_steps
    if micro % data_parallel:
        raise ConfigError(
            f"each micro-batch of {micro} sequences (global_batch_size={train.global_batch_size} / "
            f"{train.accumulation_steps} accumulation steps) must split evenly over the {data_parallel} "
            f"data-parallel devices of mesh {dict(mesh.shape)}; adjust train.global_batch_size, "
            f"train.micro_batch_size or the mesh"
        )
    if train.global_batch_size % jax.process_count():
        raise ConfigError(
            f"global_batch_size={train.global_batch_size} must split over {jax.process_count()} processes"
        )
    model = abstract_model(cfg)
    graphdef = nnx.split(model)[0]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    param_shardings = tree_shardings(params, logical_axes(model), mesh)
    optimizer = make_optimizer(train)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer, lambda _, s: s, opt_state, param_shardings, transform_non_params=lambda _: replicated(mesh)
    )
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    histories = jax.eval_shape(lambda: fp8_histories(cfg))  # FP8 amax histories: tiny, on every device
    shardings = {
        "params": param_shardings,
        "opt_state": opt_shardings,
        "fp8": jax.tree.map(lambda _: replicated(mesh), histories),
        "rng": replicated(mesh),
    }
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        {"params": params, "opt_state": opt_state, "fp8": histories, "rng": rng},
        shardings,
    )
    setup = Setup(
        experiment,
        mesh,
        graphdef,
        optimizer,
        abstract,
        shardings,
        count_params(model),
        train.global_batch_size // jax.process_count(),
    )
    if cfg.remat == "auto":
        per_device, per_replica = micro // data_parallel, train.global_batch_size // data_parallel
        smaller = tuple(d for d in range(1, per_device) if per_replica % d == 0) if capped else ()
        resolved = resolve_remat(
            experiment,
            state_bytes(setup),
            per_device,
            next(d for d in mesh.devices.flat if d.process_index == jax.process_index()),  # one whose memory it reads
            smaller,
            lambda candidate: compiled_peak(build_setup(candidate, devices)),
            fsdp=mesh.shape["fsdp"] > 1,
        )
        return build_setup(resolved, devices)
    return setup


def state_bytes(setup: Setup) -> int:
    """Bytes per device of what a train step holds besides activations: weights, optimizer state and gradients
    in their shardings; with accumulation, the gradients' running sum; under FSDP, the compute-dtype weights
    gathered whole along fsdp, otherwise their sharded compute-dtype copy. For the full 2.9B MLRA-4 with FSDP
    on 2 x H100 this is 32.1 GiB, against XLA's peak less the activations of 26.5-32.9 GiB
    (experiments/results/train_fsdp_h100x2.json)."""
    memory = memory_estimate(setup)
    fsdp = setup.mesh.shape.get("fsdp", 1)
    accumulated = memory["gradients"] if setup.experiment.train.accumulation_steps > 1 else 0
    compute_copy = memory["params"] * fsdp * jnp.dtype(setup.experiment.model.dtype).itemsize // 4
    return sum(memory.values()) + accumulated + compute_copy


def init_state(setup: Setup) -> dict[str, Any]:
    """Fresh weights, optimizer state, FP8 amax histories and RNG, created directly in their shardings (never whole
    on one device)."""
    cfg, seed = setup.experiment.model, setup.experiment.train.seed

    def init() -> dict[str, Any]:
        params = nnx.to_pure_dict(nnx.state(init_model(cfg, seed), nnx.Param))
        return {
            "params": params,
            "opt_state": setup.optimizer.init(params),
            "fp8": fp8_histories(cfg),
            "rng": jax.random.key_data(jax.random.key(seed)),
        }

    with jax.set_mesh(setup.mesh):
        return jax.jit(init, out_shardings=setup.state_shardings)()


def state_from_params(setup: Setup, params: dict[str, Any]) -> dict[str, Any]:
    """A fresh start from given weights (nested like the abstract params): a new optimizer state, fresh FP8
    histories and the seed's RNG, as init_state makes them, in the run's shardings."""
    cfg, seed = setup.experiment.model, setup.experiment.train.seed

    def init(p: dict[str, Any]) -> dict[str, Any]:
        return {
            "params": p,
            "opt_state": setup.optimizer.init(p),
            "fp8": fp8_histories(cfg),
            "rng": jax.random.key_data(jax.random.key(seed)),
        }

    with jax.set_mesh(setup.mesh):
        return jax.jit(init, in_shardings=(setup.state_shardings["params"],), out_shardings=setup.state_shardings)(
            params
        )


def fresh_fp8_histories(setup: Setup) -> dict[str, Any]:
    """Fresh FP8 amax histories ({} unless the model keeps them) in the run's shardings."""
    with jax.set_mesh(setup.mesh):
        return jax.jit(lambda: fp8_histories(setup.experiment.model), out_shardings=setup.state_shardings["fp8"])()


def memory_estimate(setup: Setup) -> dict[str, int]:
    """Bytes per device: parameters, optimizer state, gradients (as the parameters)."""
    params = bytes_per_device(setup.abstract_state["params"], setup.state_shardings["params"])
    opt = bytes_per_device(setup.abstract_state["opt_state"], setup.state_shardings["opt_state"])
    return {"params": params, "optimizer_state": opt, "gradients": params}


def compiled_memory(setup: Setup) -> dict[str, int] | None:
    """XLA's own per-device accounting of the compiled train step (activations included)."""
    step = jit_train_step(setup)
    tokens = jax.ShapeDtypeStruct(
        (setup.experiment.train.global_batch_size, setup.experiment.train.seq_len + 1),
        jnp.int32,
        sharding=batch_sharding(setup.mesh),
    )
    state = setup.abstract_state
    with jax.set_mesh(setup.mesh):
        analysis = step.lower(state["params"], state["opt_state"], state["fp8"], tokens).compile().memory_analysis()
    if analysis is None:
        return None
    return {
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
    }


def compiled_peak(setup: Setup) -> int | None:
    """XLA's per-device count of the compiled train step: its arguments and temporaries (the updated state
    reuses the donated arguments)."""
    analysis = compiled_memory(setup)
    return None if analysis is None else analysis["arguments"] + analysis["temporaries"]


def jit_train_step(setup: Setup):
    """The train step jitted with the state's shardings; params, optimizer state and FP8 histories are donated."""
    train, shardings = setup.experiment.train, setup.state_shardings
    step = make_train_step(
        setup.graphdef,
        setup.optimizer,
        train.accumulation_steps,
        micro_batch_sharding(setup.mesh),
        train.loss_chunk,
        accumulation_weight_shardings(setup),
    )
    return jax.jit(
        step,
        in_shardings=(shardings["params"], shardings["opt_state"], shardings["fp8"], batch_sharding(setup.mesh)),
        out_shardings=(shardings["params"], shardings["opt_state"], shardings["fp8"], replicated(setup.mesh)),
        donate_argnums=(0, 1, 2),
    )


def fsdp_gather(setup: Setup) -> str | None:
    """Where FSDP gathers the compute-dtype weights under gradient accumulation: mesh.fsdp_gather with "auto"
    resolved ("step" under model.remat none, else "micro_batch"); None without FSDP or accumulation. Holding the
    gathered weights costs their own size where nothing is recomputed; under a remat policy XLA's schedule of the
    recomputation held far more (full MLRA-4, FSDP over 2 x H100, 6 sequences per GPU under dots_attn: 61.9 GiB
    of temporaries against 40.8, experiments/results/train_fsdp_gather.json), which the memory estimate does not
    model: remat=auto sets "step" under a policy only where the compiled step fits (resolve_remat)."""
    experiment = setup.experiment
    if experiment.train.accumulation_steps == 1 or setup.mesh.shape["fsdp"] == 1:
        return None
    gather = experiment.mesh.fsdp_gather
    if gather == "auto":
        return "step" if experiment.model.remat == "none" else "micro_batch"
    return gather


def accumulation_weight_shardings(setup: Setup) -> tuple[Any, Any] | None:
    """make_train_step's weight_shardings: where fsdp_gather is "step", the parameters' shardings and those of
    their compute-dtype copy gathered along fsdp; else None."""
    if fsdp_gather(setup) != "step":
        return None
    params = setup.state_shardings["params"]
    return params, jax.tree.map(lambda s: without_axis(s, "fsdp"), params)


def global_batch(setup: Setup, local: np.ndarray) -> jax.Array:
    """This process's rows of a batch -> the global array sharded over the data-parallel axes."""
    return jax.make_array_from_process_local_data(batch_sharding(setup.mesh), local)
