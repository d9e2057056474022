"""The registry holds all 30 paper runs with the reference's exact parameter counts and names."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from mlra_jax.experiments import all_experiments, experiment_names, get_experiment
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.config import ConfigError
from mlra_jax.interop import convert_from_reference, from_state_dict, reference_shapes, to_state_dict
from mlra_jax.interop.reference_config import reference_config
from mlra_jax.model import abstract_model, count_params
from mlra_jax.params import flat_params

PAPER = json.loads((Path(__file__).parent / "reference" / "paper_experiments.json").read_text())
BY_REFERENCE = {e.reference_key: e for e in all_experiments() if e.reference_key}


def test_every_paper_run_is_registered_once():
    assert len(PAPER) == 30
    assert set(BY_REFERENCE) == set(PAPER)
    assert all(
        name in experiment_names()
        for name in (
            "mlra4_2p9b",
            "gqa_2p9b",
            "mla_gated_2p9b",
            "gqa_normal_init_2p9b",
            "mla_double_heads_2p9b",
            "mlra2_no_scale_2p9b",
        )
    )


def test_every_variant_has_a_tiny_run():
    variants = {get_experiment(n).model.variant for n in experiment_names() if n.endswith("_tiny")}
    assert len(variants) == 11


@pytest.mark.parametrize("key", sorted(PAPER))
def test_config_params_and_names_match_reference(key):
    spec, experiment = PAPER[key], BY_REFERENCE[key]
    cfg = experiment.model
    fields, model_file = reference_config(cfg)
    assert model_file == spec["reference_model_file"]
    assert {k: fields[k] for k in spec["config"]} == spec["config"]
    assert count_params(abstract_model(cfg)) == spec["num_params"]
    shapes = reference_shapes(cfg)
    assert len(shapes) == spec["num_state_dict_entries"]
    layer0_and_top = {
        k: list(v) for k, v in shapes.items() if not k.startswith("transformer.h.") or k.startswith("transformer.h.0.")
    }
    assert layer0_and_top == spec["state_dict_layer0_and_top"]
    train = experiment.train
    assert (
        train.peak_lr,
        train.warmup_steps,
        train.total_steps,
        train.global_batch_size,
        train.seq_len,
        train.weight_decay,
        train.grad_clip,
        train.seed,
    ) == (1.6e-4, 2000, 100_000, 480, 2048, 0.1, 1.0, 5000)


@pytest.mark.parametrize("key", sorted(PAPER))
def test_full_size_round_trip_shapes(key):
    """ours -> reference -> ours preserves every path and shape at 2.9B (traced, not allocated)."""
    cfg = BY_REFERENCE[key].model
    abstract = flat_params(abstract_model(cfg))
    back = jax.eval_shape(lambda p: convert_from_reference(to_state_dict(p, cfg), cfg), abstract)
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in abstract.items()}


def small_version(cfg):
    """The same variant and options at a size that converts in milliseconds."""
    heads = {}
    if cfg.n_head == 48:  # the double-heads ablation keeps twice the heads on the same KV cache
        heads = {"n_head": 8} | ({"group_size": 4} if cfg.variant == "gqa" else {})
    return tiny_model(
        cfg.variant,
        n_layer=2,
        vocab_size=64,
        gated=cfg.gated,
        latent_scale=cfg.latent_scale,
        output_init=cfg.output_init,
        **heads,
    )


@pytest.mark.parametrize("key", sorted(PAPER))
def test_round_trip_is_identity_both_ways(key):
    """The same variant and options at a small size, with real values, in both directions."""
    small = small_version(BY_REFERENCE[key].model)
    rng = np.random.default_rng(0)  # random values: no zero or repeated tensors that could hide a swapped mapping
    params = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in flat_params(abstract_model(small)).items()}
    state_dict = to_state_dict(params, small)
    back = from_state_dict(state_dict, small)
    assert set(back) == set(params)
    for name in params:
        np.testing.assert_array_equal(back[name], params[name], err_msg=name)
    again = to_state_dict(back, small)
    assert set(again) == set(state_dict)
    for name in state_dict:
        np.testing.assert_array_equal(again[name], state_dict[name], err_msg=name)


def test_unknown_experiment_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown experiment 'mlra4_3b'.*mlra4_2p9b"):
        get_experiment("mlra4_3b")
