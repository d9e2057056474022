"""The latent region's layout per mode (tensor_parallel's pure layout functions): specs, manual axes, widening."""

from jax.sharding import PartitionSpec as P

from mlra_jax.tensor_parallel import (
    TENSOR,
    WIDEN_REPLICATED_TRAINING_INPUTS,
    LatentPlan,
    decode_layout,
    prefill_layout,
    train_layout,
)

MLRA4_TP4 = LatentPlan(blocks=4, branches=4, heads=24, tp=4)  # one latent block per device
MLA_TP4 = LatentPlan(blocks=1, branches=1, heads=24, tp=4)  # one block, heads split


def test_mlra4_at_tp4_splits_blocks_and_keeps_the_data_axes_automatic_in_training():
    layout = train_layout(MLRA4_TP4, has_mask=False, ndims=(4, 4))
    assert layout.manual_axes == {TENSOR} and layout.widen_replicated == WIDEN_REPLICATED_TRAINING_INPUTS
    assert layout.queries == P(None) and layout.stored_kv == (P(None, None, TENSOR, None), P(None))
    assert layout.kv_up == P(TENSOR, None, None, None) and not layout.kv_up_by_heads
    assert layout.out == P(None, None, TENSOR, None) and layout.mask == P()
    assert prefill_layout(MLRA4_TP4, True, (4, 4)).widen_replicated is False


def test_mla_splits_its_heads_and_replicates_the_latent():
    layout = prefill_layout(MLA_TP4, has_mask=True, ndims=(4, 4))
    assert layout.heads_sharded_in and layout.kv_up_by_heads
    assert layout.queries == P(None, None, TENSOR, None) and layout.kv_up == P(None, None, TENSOR, None)
    assert layout.stored_kv == (P(None, None, None, None), P(None)) and layout.mask == P(None)


def test_a_decode_step_makes_every_automatic_axis_manual():
    automatic = frozenset({"data", "fsdp", TENSOR})
    split = decode_layout(MLRA4_TP4, True, (4, 4), batch_axes=("data",), automatic=automatic)
    assert split.manual_axes == automatic and split.queries == P(("data",)) and split.mask == P(("data",))
    assert split.stored_kv == (P(("data",), None, TENSOR, None), P(("data",)))
    # a batch that does not split: whole on every device, every axis still manual (no partly automatic region)
    whole = decode_layout(MLRA4_TP4, True, (4, 4), batch_axes=(), automatic=automatic)
    assert whole.manual_axes == automatic and whole.queries == P(None)


def test_widening_touches_only_replicated_floating_inputs_in_training():
    import jax.numpy as jnp

    layout = train_layout(MLRA4_TP4, False, (4, 4))
    x = jnp.ones((2, 2), jnp.bfloat16)
    widened = layout.widen(x, P(None, None))
    assert widened.dtype == (jnp.float32 if WIDEN_REPLICATED_TRAINING_INPUTS else jnp.bfloat16)
    assert layout.widen(x, P(None, TENSOR)).dtype == jnp.bfloat16
    assert layout.widen(jnp.ones(2, jnp.int32), P(None)).dtype == jnp.int32
