"""The reference GPTConfig fields and model file <-> our ModelConfig.

Only files of the official repository are named or read: `OFFICIAL_MODEL_FILES` lists its model/*.py
(SongtaoLiu0823/MLRA at commit 7e0eb5c, without the *_gen.py decoding scripts). An option that changes
nothing the variant computes falls back to the base file: `output_init` only initializes new weights
(model/mlra_4.py loads and runs a normal-init MLRA-4 checkpoint exactly), and `latent_scale` exists only
in the latent family. A gated MHA is the official gqa_gated.py with groups of one query head. Every other
combination without an official file (gated GLA-4, no-scale MLRA-4, gated and no-scale together, ...)
is a ConfigError that names the files there are.
"""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath
from typing import Any, Mapping

from mlra_jax.config import ConfigError, ModelConfig
from mlra_jax.variants import SPECS

OFFICIAL_MODEL_FILES = frozenset(
    f"model/{stem}.py"
    for stem in (
        "gla_2",
        "gla_2_gated",
        "gla_2_no_scale",
        "gla_2_normal_initialization",
        "gla_4",
        "gla_4_normal_initialization",
        "gqa",
        "gqa_gated",
        "gqa_normal_initialization",
        "gta",
        "gta_normal_initialization",
        "mfa",
        "mfa_normal_initialization",
        "mha",
        "mha_normal_initialization",
        "mla",
        "mla_gated",
        "mla_no_scale",
        "mla_normal_initialization",
        "mlra_2",
        "mlra_2_gated",
        "mlra_2_no_scale",
        "mlra_4",
        "mlra_4_gated",
        "tpa",
        "tpa_normal_initialization",
    )
)

# reference model file stem -> our variant (MQA runs through gqa.py: told apart by its group size)
_FILE_VARIANTS = {spec.reference_stem: name for name, spec in SPECS.items() if spec.reference_file is None}
# reference GPTConfig field -> ModelConfig field
_FIELDS = {
    "n_layer": "n_layer",
    "n_head": "n_head",
    "n_embd": "n_embd",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "block_size": "max_seq_len",
    "head_dim": "head_dim",
    "group_size": "group_size",
    "q_lora_rank": "q_lora_rank",
    "share_q_dim": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "rank": "tpa_rank",
    "q_rank": "tpa_q_rank",
}
_SUFFIXES = {
    "_gated": {"gated": True},
    "_no_scale": {"latent_scale": False},
    "_normal_initialization": {"output_init": "normal"},
}


def config_from_reference(fields: Mapping[str, Any], reference_model: str, **overrides: Any) -> ModelConfig:
    """ModelConfig from reference GPTConfig fields and its model file (e.g. 'model/mlra_4_gated.py')."""
    path = PurePosixPath(reference_model)
    if f"model/{path.name}" not in OFFICIAL_MODEL_FILES:
        raise ConfigError(
            f"reference model file {reference_model!r} is not a model file of the official repository "
            f"(those are {', '.join(sorted(OFFICIAL_MODEL_FILES))})"
        )
    stem, options = path.stem, {}
    for suffix, option in _SUFFIXES.items():
        if stem.endswith(suffix):
            stem, options = stem.removesuffix(suffix), options | option
    kwargs = {_FIELDS[k]: v for k, v in fields.items() if k in _FIELDS}
    variant = _FILE_VARIANTS[stem]
    if variant == "gqa" and kwargs.get("group_size") == kwargs.get("n_head"):
        variant = "mqa"  # the reference runs MQA through gqa.py with group_size = n_head
    if "group_size" not in SPECS[variant].required_fields:  # MQA's is implied (n_head): left unset as in ours
        kwargs.pop("group_size", None)
    return ModelConfig(variant=variant, **kwargs, **options, **overrides)


def reference_file(cfg: ModelConfig) -> str:
    """The official model file that computes `cfg` (see the module docstring); ConfigError where none does."""
    stem = "gqa" if cfg.variant == "mha" and cfg.gated else cfg.spec.reference_stem
    options = [
        suffix
        for suffix, on in (
            ("_gated", cfg.gated),
            ("_no_scale", cfg.spec.latent_layout is not None and not cfg.latent_scale),
        )
        if on
    ]
    file = f"model/{stem}{''.join(options)}.py"
    if file not in OFFICIAL_MODEL_FILES:
        wanted = " and ".join({"_gated": "gated attention", "_no_scale": "no latent scales"}[o] for o in options)
        theirs = sorted(
            f
            for f in OFFICIAL_MODEL_FILES
            if PurePosixPath(f).stem.startswith(stem + "_") or PurePosixPath(f).stem == stem
        )
        raise ConfigError(
            f"the official code has no {cfg.spec.display_name} with {wanted} (no {file}; its "
            f"{cfg.spec.display_name} files are {', '.join(theirs)}), so this model cannot be written "
            f"in its format; keep it as a run or export it with `convert to-hf`"
        )
    normal = f"model/{stem}_normal_initialization.py"
    if cfg.output_init == "normal" and not options and normal in OFFICIAL_MODEL_FILES:
        return normal
    return file


def reference_config(cfg: ModelConfig) -> tuple[dict[str, Any], str]:
    """(reference GPTConfig fields, official model file) for a ModelConfig; ConfigError where no file computes it."""
    file = reference_file(cfg)
    ref_names = {ours: ref for ref, ours in _FIELDS.items() if ref != "share_q_dim"}
    if cfg.variant == "mfa":
        ref_names["q_lora_rank"] = "share_q_dim"
    fields = {
        ref_names[f.name]: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name in ref_names and getattr(cfg, f.name) is not None
    }
    if cfg.variant == "mqa":
        fields["group_size"] = cfg.n_head
    if cfg.variant == "mha" and cfg.gated:
        fields["group_size"] = 1  # gqa_gated.py with one query head per KV head
    return fields, file
