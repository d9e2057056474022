"""FSDP under gradient accumulation: with mesh.fsdp_gather="step" the compute-dtype weights are cast and gathered
once per step, before the micro-batches, with the gradients of gathering them in each micro-batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import micro_experiment

from mlra_jax.params import compute_params
from mlra_jax.training.state import (
    accumulation_weight_shardings,
    build_setup,
    global_batch,
    init_state,
    jit_train_step,
)
from mlra_jax.training.step import make_train_step


def step_setup(*overrides: str):
    experiment = micro_experiment(
        "mlra4_tiny",
        "--model.compute_dtype=bfloat16",
        "--train.global_batch_size=32",
        "--train.micro_batch_size=8",
        *overrides,
    )
    return build_setup(experiment, None if "--mesh.fsdp=8" in overrides else jax.devices()[:1])


def equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def casts_and_gathers(setup) -> tuple[int, int, int]:
    """(weights cast to bfloat16 inside the micro-batch loop, outside it, sharding constraints before the loop
    that leave a weight whole along fsdp)."""
    train = setup.experiment.train
    step = make_train_step(
        setup.graphdef,
        setup.optimizer,
        train.accumulation_steps,
        None,
        train.loss_chunk,
        accumulation_weight_shardings(setup),
    )
    state = setup.abstract_state
    tokens = jax.ShapeDtypeStruct((train.global_batch_size, train.seq_len + 1), jnp.int32)
    with jax.set_mesh(setup.mesh):
        jaxpr = jax.make_jaxpr(step)(state["params"], state["opt_state"], state["fp8"], tokens).jaxpr
    cast = jax.eval_shape(lambda p: compute_params(p, jnp.bfloat16), state["params"])
    weight_shapes = {  # the weights that the layers read in bfloat16 (the embedding's lookup reads float32)
        a.shape for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(cast)) if a.dtype != b.dtype
    }
    weight_shapes |= {(1, *shape[1:]) for shape in weight_shapes}  # one layer of a stacked parameter

    def is_weight_cast(eqn) -> bool:
        if eqn.primitive.name != "convert_element_type":
            return False
        operand = eqn.invars[0]
        return (
            eqn.params["new_dtype"] == jnp.bfloat16
            and operand.aval.dtype == jnp.float32
            and operand.aval.shape in weight_shapes
        )

    (loop,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    before = jaxpr.eqns[: jaxpr.eqns.index(loop)]
    inside = sum(map(is_weight_cast, equations(loop.params["jaxpr"].jaxpr)))
    outside = sum(map(is_weight_cast, before))
    gathers = sum(
        eqn.primitive.name == "sharding_constraint"
        and eqn.invars[0].aval.shape in weight_shapes
        and "fsdp" not in str(eqn.params["sharding"].spec)
        for eqn in before
    )
    reductions = [  # the gradients put back into the weights' sharding at each micro-batch
        eqn.invars[0].aval.dtype
        for eqn in equations(loop.params["jaxpr"].jaxpr)
        if eqn.primitive.name == "sharding_constraint"
        and eqn.invars[0].aval.shape in weight_shapes
        and "fsdp" in str(eqn.params["sharding"].spec)
    ]
    assert set(reductions) <= {jnp.dtype(jnp.bfloat16)}  # reduced in the compute dtype: no float32 copy unsharded
    assert bool(reductions) == bool(gathers)
    return inside, outside, gathers


def test_the_weights_are_cast_and_gathered_once_per_step_not_per_micro_batch():
    inside, outside, gathers = casts_and_gathers(step_setup("--mesh.data=1", "--mesh.fsdp=8"))
    assert inside == 0 and outside > 0 and gathers > 0
    inside, outside, gathers = casts_and_gathers(
        step_setup("--mesh.data=1", "--mesh.fsdp=8", "--mesh.fsdp_gather=micro_batch")
    )
    assert inside > 0 and outside == 0 and gathers == 0  # each micro-batch casts and gathers what it reads
    inside, outside, gathers = casts_and_gathers(step_setup())  # one device: nothing to gather
    assert inside > 0 and outside == 0 and gathers == 0


def test_auto_gathers_once_per_step_only_where_the_layers_recompute_nothing():
    fsdp = ("--mesh.data=1", "--mesh.fsdp=8")
    assert casts_and_gathers(step_setup(*fsdp, "--model.remat=none"))[2] > 0
    assert casts_and_gathers(step_setup(*fsdp, "--model.remat=dots_attn"))[2] == 0
    assert casts_and_gathers(step_setup(*fsdp, "--model.remat=dots_attn", "--mesh.fsdp_gather=step"))[2] > 0


def trained(setup):
    train = setup.experiment.train
    with jax.set_mesh(setup.mesh):
        state = init_state(setup)
        tokens = jax.random.randint(jax.random.key(1), (train.global_batch_size, train.seq_len + 1), 0, 200, jnp.int32)
        params, opt_state, _, metrics = jit_train_step(setup)(
            state["params"], state["opt_state"], state["fp8"], global_batch(setup, jax.device_get(tokens))
        )
    return jax.device_get((params, opt_state)), float(metrics["loss"])


def test_gathering_once_per_step_trains_as_gathering_per_micro_batch():
    once, loss_once = trained(step_setup("--mesh.data=1", "--mesh.fsdp=8"))
    each, loss_each = trained(step_setup("--mesh.data=1", "--mesh.fsdp=8", "--mesh.fsdp_gather=micro_batch"))
    _, loss_alone = trained(step_setup())
    assert loss_once == loss_each == pytest.approx(loss_alone, rel=1e-6)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(each), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_dry_run_says_where_fsdp_gathers_the_weights(capsys):
    from mlra_jax.train import main

    argv = ["--experiment=mlra4_tiny", "--mesh.data=1", "--mesh.fsdp=8", "--train.global_batch_size=16"]
    argv += ["--train.micro_batch_size=8", "--dry_run"]
    assert main(argv) == 0 and "FSDP gathers the weights once per step" in capsys.readouterr().out
    assert main([*argv, "--model.remat=dots_attn"]) == 0
    assert "FSDP gathers the weights in each micro-batch" in capsys.readouterr().out
