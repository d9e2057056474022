"""The logical-axis table, the mesh, sharded initialization and the FLOP count."""

import jax
import pytest
from helpers import micro_experiment
from jax.sharding import PartitionSpec as P
from mlra_jax.experiments import get_experiment

from mlra_jax.config import ConfigError, MeshConfig
from mlra_jax.metrics import peak_flops, training_flops_per_token
from mlra_jax.sharding import logical_to_spec, make_mesh, mesh_shape
from mlra_jax.training.state import build_setup, init_state


def test_mesh_fills_minus_one_and_rejects_bad_shapes():
    assert mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=2), 8) == (2, 2, 2)
    assert mesh_shape(MeshConfig(data=1, fsdp=-1), 8) == (1, 8, 1)
    with pytest.raises(ConfigError, match="needs 6 devices but 8 are available"):
        mesh_shape(MeshConfig(data=3, fsdp=2), 8)
    with pytest.raises(ConfigError, match="8 devices are not divisible by 3"):
        mesh_shape(MeshConfig(data=-1, fsdp=3), 8)
    with pytest.raises(ConfigError, match="at most one -1"):
        MeshConfig(data=-1, fsdp=-1)


def test_logical_rules():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert logical_to_spec(("embed", "q_heads", "head_dim"), (64, 4, 16), mesh) == P("fsdp", "tensor", None)
    assert logical_to_spec(("vocab", "embed"), (50304, 64), mesh) == P("tensor", "fsdp")
    # a dimension the mesh axis does not divide stays whole; FSDP then takes the largest free dimension
    assert logical_to_spec(("embed", "q_heads", "head_dim"), (64, 3, 16), mesh) == P("fsdp", None, None)
    assert logical_to_spec(("q_lora", "q_heads", "qk_head_dim"), (96, 4, 48), mesh) == P("fsdp", "tensor", None)
    assert logical_to_spec(("layers", "latent_blocks", "latent"), (2, 4, 16), mesh) == P(None, "tensor", "fsdp")


def test_init_creates_every_tensor_already_sharded():
    experiment = micro_experiment("mlra4_tiny", "--mesh.data=1", "--mesh.fsdp=8")
    setup = build_setup(experiment)
    state = init_state(setup)
    for leaf, sharding in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(setup.state_shardings["params"])):
        assert leaf.sharding == sharding
        assert leaf.addressable_shards[0].data.size * 8 == leaf.size  # 1/8 of every tensor per device
    for leaf in jax.tree.leaves(state["opt_state"]):
        if leaf.ndim:
            assert leaf.addressable_shards[0].data.size * 8 == leaf.size


def test_flops_per_token_and_peak():
    cfg = get_experiment("mha_2p9b").model
    n = 2872593408 - 24 * 2 * 3072 - 3072  # matmul parameters: all but the norms
    attention = 3 * 24 * 2 * 24 * (128 + 128) * (2048 + 1) / 2
    assert training_flops_per_token(cfg, 2048) == pytest.approx(6 * n + attention)
    mlra4, mla = get_experiment("mlra4_2p9b").model, get_experiment("mla_2p9b").model
    # MLRA-4 attends with four branches of all heads: four times MLA's attention-core FLOPs
    core = lambda c: training_flops_per_token(c, 2048) - 6 * (2873220096 if c is mlra4 else 2872052736)
    assert core(mlra4) > 3 * core(mla)
    assert peak_flops(jax.devices("cpu")[0]) is None


def test_activations_are_split_by_batch_not_by_the_fsdp_sharded_width():
    """Under an FSDP mesh the embedding's d is split over fsdp; the layers' inputs and the loss's logits are
    constrained to split the batch instead (each device whole sequences), where the batch divides."""
    import jax.numpy as jnp
    from flax import nnx

    from mlra_jax.model import init_model
    from mlra_jax.sharding import constrain_batch
    from mlra_jax.training.step import loss_fn

    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    with jax.set_mesh(mesh):
        specs = lambda f, x: [
            eqn.params["sharding"].spec
            for eqn in jax.make_jaxpr(f)(x).jaxpr.eqns
            if eqn.primitive.name == "sharding_constraint"
        ]
        assert specs(constrain_batch, jnp.zeros((8, 4, 2))) == [P(("data", "fsdp"), None, None)]
        assert specs(constrain_batch, jnp.zeros((6, 4, 2))) == []  # 6 sequences do not split over 8 devices
        experiment = micro_experiment("mlra4_tiny")
        model = init_model(experiment.model)
        graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
        jaxpr = jax.make_jaxpr(lambda p: loss_fn(graphdef, p, jnp.zeros((8, 33), jnp.int32), 16))(params)

    def constraints(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "sharding_constraint":
                yield eqn.params["sharding"].spec, eqn.outvars[0].aval.shape
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from constraints(inner)

    found = list(constraints(jaxpr.jaxpr))
    width, vocab = experiment.model.n_embd, experiment.model.vocab_size
    assert (P(("data", "fsdp"), None, None), (8, 32, width)) in found  # the embedding's output, each layer's
    assert (P(("data", "fsdp"), None, None), (8, 16, vocab)) in found  # one chunk's logits
    x = jnp.zeros((8, 2))
    assert constrain_batch(x) is x  # outside a mesh: as it is
