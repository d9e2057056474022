"""Bad configs fail at construction, naming the field and the allowed values."""

import dataclasses

import pytest
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.config import ConfigError, ModelConfig, TrainConfig
from mlra_jax.model import init_model


@pytest.mark.parametrize("variant,blocks,rank", [("mlra4", 4, 62), ("mlra2", 4, 62), ("gla4", 4, 62), ("gla2", 2, 61)])
def test_kv_lora_rank_not_divisible_by_latent_blocks(variant, blocks, rank):
    with pytest.raises(ConfigError, match=f"kv_lora_rank={rank} is not divisible by the {blocks} latent blocks"):
        tiny_model(variant, kv_lora_rank=rank)


def test_n_head_not_divisible_by_group_size():
    with pytest.raises(ConfigError, match=r"n_head=4 is not divisible by group_size=3.*\[1, 2, 4\]"):
        tiny_model("gqa", group_size=3)
    with pytest.raises(ConfigError, match="group_size=3"):
        tiny_model("gta", group_size=3)


@pytest.mark.parametrize("variant,groups,heads", [("gla2", 2, 5), ("gla4", 4, 6), ("mlra2", 2, 5)])
def test_n_head_not_divisible_by_latent_groups(variant, groups, heads):
    with pytest.raises(ConfigError, match=f"n_head={heads} is not divisible by the {groups} latent groups"):
        tiny_model(variant, n_head=heads)


def test_mlra4_takes_any_head_count():
    assert init_model(tiny_model("mlra4", n_head=3, n_layer=1, vocab_size=32)).config.n_head == 3


def test_odd_rope_width():
    with pytest.raises(ConfigError, match="qk_rope_head_dim=7 is odd"):
        tiny_model("mla", qk_rope_head_dim=7)
    with pytest.raises(ConfigError, match="head_dim=33 is odd"):
        tiny_model("gqa", head_dim=33)
    with pytest.raises(ConfigError, match="head_dim=30: GTA"):
        tiny_model("gta", head_dim=30)


def test_unknown_variant_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="variant='mlra8' is not valid; allowed values: mha, mqa, gqa, mla"):
        ModelConfig(variant="mlra8", n_layer=1, n_head=4, n_embd=64, intermediate_size=64)


def test_missing_and_foreign_fields():
    with pytest.raises(ConfigError, match="variant 'mla' needs kv_lora_rank"):
        dataclasses.replace(tiny_model("mla"), kv_lora_rank=None)
    with pytest.raises(ConfigError, match="group_size do not apply to variant 'mla'"):
        dataclasses.replace(tiny_model("mla"), group_size=2)
    with pytest.raises(ConfigError, match="group_size=2 contradicts variant 'mqa'"):
        tiny_model("mqa", group_size=2)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("n_layer", 0, "n_layer=0 must be a positive integer"),
        ("compute_dtype", "fp8", "compute_dtype='fp8' is not valid; allowed values: float32, bfloat16, float16"),
        (
            "attention_impl",
            "flash",
            "attention_impl='flash' is not valid; allowed values: auto, xla, cudnn, splash, pallas, mlra_kernel",
        ),
        ("output_init", "xavier", "output_init='xavier' is not valid; allowed values: zero, normal"),
        ("remat", "some", "remat='some' is not valid"),
        ("rope_theta", 0.0, "rope_theta=0.0 must be a positive number"),
        ("rope_theta", float("nan"), "rope_theta=nan must be a positive number"),
    ],
)
def test_scalar_fields(field, value, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(tiny_model("mha"), **{field: value})


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("peak_lr", float("inf"), "peak_lr=inf must be a positive number"),
        ("eps", 0.0, "eps=0.0 must be positive"),
        ("eps", -1e-8, "eps=-1e-08 must be positive"),
        ("weight_decay", -0.1, "weight_decay=-0.1 must be >= 0"),
    ],
)
def test_optimizer_fields_must_be_finite_and_in_range(field, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{field: value})


def test_nan_temperature_is_refused():
    from mlra_jax.decode.generator import GenerationError, Sampling

    with pytest.raises(GenerationError, match="temperature=nan must be >= 0"):
        Sampling(temperature=float("nan"))


def test_train_config():
    with pytest.raises(ConfigError, match="warmup_steps=20 must lie in"):
        TrainConfig(total_steps=10, warmup_steps=20)
    with pytest.raises(ConfigError, match="global_batch_size=0"):
        TrainConfig(global_batch_size=0)


@pytest.mark.parametrize(
    "argument, message",
    [
        ("--train.seed=18446744073709551615", "seed=18446744073709551615 must be a whole number in [0, 2**32)"),
        ("--train.global_batch_size=99999999999999999999", "global_batch_size=99999999999999999999 must be a positive"),
        ("--model.n_layer=100000000000000000000000", "n_layer=100000000000000000000000 must be a positive integer"),
        ("--model.n_layer=100000", "n_layer=100000 is more layers than any model has"),
        ("--compile_for=", "--compile_for is empty"),
        ("--distributed --num_processes=0", "--num_processes=0 must be at least 1"),
        ("--distributed", "--distributed: coordinator_address should be defined"),
    ],
)
def test_values_out_of_range_exit_2_naming_the_field(argument, message, capsys, monkeypatch, tmp_path):
    """Each in one error line with exit 2, before any work: --dry_run reports no absurd model, and no run
    directory is made."""
    import jax

    from mlra_jax.train import main as train_main

    def no_cluster(**kwargs):  # what JAX raises where no cluster is detected (once a backend runs, it refuses)
        raise ValueError("coordinator_address should be defined.")

    for variable in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
    monkeypatch.chdir(tmp_path)
    assert train_main(["--experiment=mlra4_tiny", "--dry_run", *argument.split()]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err and "unexpected" not in err
    assert not list(tmp_path.iterdir())
