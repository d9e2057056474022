"""The logical-axis table, the mesh, sharded initialization and the FLOP count."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import micro_experiment
from mlra_jax.config import ConfigError, MeshConfig
from mlra_jax.experiments import get_experiment
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
