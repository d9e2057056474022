"""reference_config names only files of the official repository, and refuses what none of them computes."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.config import ConfigError
from mlra_jax.interop.reference_config import config_from_reference, reference_config
from mlra_jax.variants import LATENT_VARIANTS, VARIANTS

RECORDED = [
    line
    for line in (Path(__file__).parent / "reference" / "official_model_files.txt").read_text().splitlines()
    if line and not line.startswith("#")
]
# the model files (the *_gen.py files are decoding scripts of MLRA-2 and MLRA-4, not models to load weights into)
MODEL_FILES = {f for f in RECORDED if not f.endswith("_gen.py")}
OPTIONS = list(itertools.product(VARIANTS, (False, True), (True, False), ("zero", "normal")))


def config(variant: str, gated: bool, latent_scale: bool, output_init: str):
    return tiny_model(variant, n_layer=1, gated=gated, latent_scale=latent_scale, output_init=output_init)


def computed(cfg) -> dict:
    """The fields that change what a model computes (output_init only initializes; latent_scale exists only in
    the latent family)."""
    fields = dataclasses.asdict(cfg)
    fields["output_init"] = None
    if cfg.variant not in LATENT_VARIANTS:
        fields["latent_scale"] = None
    return fields


def test_every_accepted_combination_names_an_official_file_that_computes_it():
    named, refused = set(), []
    for variant, gated, latent_scale, output_init in OPTIONS:
        cfg = config(variant, gated, latent_scale, output_init)
        try:
            fields, file = reference_config(cfg)
        except ConfigError as err:
            assert "the official code has no" in str(err) and "files are model/" in str(err), str(err)
            refused.append((variant, gated, latent_scale))
            continue
        assert file in MODEL_FILES, (variant, gated, latent_scale, output_init, file)
        named.add(file)
        back = config_from_reference(fields, file)
        if variant == "mha" and gated:  # gqa_gated.py with groups of one query head
            assert (back.variant, back.group_size, file) == ("gqa", 1, "model/gqa_gated.py")
            back = dataclasses.replace(back, variant="mha", group_size=None)
        assert computed(back) == computed(cfg), (variant, gated, latent_scale, output_init, file)
        if output_init == "normal" and file.endswith("_normal_initialization.py"):
            assert back.output_init == "normal"
    assert named == MODEL_FILES  # every official model file is reachable
    # no gated file for GLA-4, MFA, TPA, GTA; no no-scale file for GLA-4, MLRA-4; none with both options
    assert sorted({r for r in refused}) == sorted(
        {(v, True, s) for v in ("gla4", "mfa", "tpa", "gta") for s in (True, False)}
        | {(v, g, False) for v in ("gla4", "mlra4") for g in (False, True)}
        | {(v, True, False) for v in LATENT_VARIANTS}
    )


@pytest.mark.parametrize(
    "options,file",
    [
        (dict(variant="mlra4", output_init="normal"), "model/mlra_4.py"),
        (dict(variant="mha", latent_scale=False), "model/mha.py"),
        (dict(variant="mqa", output_init="normal"), "model/gqa_normal_initialization.py"),
        (dict(variant="mla", gated=True, output_init="normal"), "model/mla_gated.py"),
        (dict(variant="gla2", latent_scale=False), "model/gla_2_no_scale.py"),
        (dict(variant="gla4", gated=True), None),
        (dict(variant="mlra4", latent_scale=False), None),
        (dict(variant="mla", gated=True, latent_scale=False), None),
    ],
)
def test_files_for_examples(options, file):
    cfg = config(**{"gated": False, "latent_scale": True, "output_init": "zero", **options})
    if file is None:
        with pytest.raises(ConfigError, match="the official code has no .* `convert to-hf`"):
            reference_config(cfg)
    else:
        assert reference_config(cfg)[1] == file


@pytest.mark.parametrize(
    "file",
    [
        "model/mlra_4_no_scale.py",
        "model/gla_4_gated.py",
        "model/mha_no_scale.py",
        "model/mlra_4_normal_initialization.py",
        "model/mlra_4_gen.py",
    ],
)
def test_reading_refuses_files_the_official_code_does_not_have(file):
    fields, _ = reference_config(config("mlra4", False, True, "zero"))
    with pytest.raises(ConfigError, match="is not a model file of the official repository"):
        config_from_reference(fields, file)
