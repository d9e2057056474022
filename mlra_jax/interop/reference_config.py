"""The reference GPTConfig fields and model file <-> our ModelConfig."""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath
from typing import Any, Mapping

from mlra_jax.config import ConfigError, ModelConfig
from mlra_jax.variants import SPECS

# reference model file stem -> our variant (MQA runs through gqa.py: told apart by its group size)
_FILE_VARIANTS = {spec.reference_stem: name for name, spec in SPECS.items() if spec.reference_file is None}
# reference GPTConfig field -> ModelConfig field
_FIELDS = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "intermediate_size": "intermediate_size",
           "vocab_size": "vocab_size", "block_size": "max_seq_len", "head_dim": "head_dim",
           "group_size": "group_size", "q_lora_rank": "q_lora_rank", "share_q_dim": "q_lora_rank",
           "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
           "qk_rope_head_dim": "qk_rope_head_dim", "rank": "tpa_rank", "q_rank": "tpa_q_rank"}
_SUFFIXES = {"_gated": {"gated": True}, "_no_scale": {"latent_scale": False},
             "_normal_initialization": {"output_init": "normal"}}


def config_from_reference(fields: Mapping[str, Any], reference_model: str, **overrides: Any) -> ModelConfig:
    """ModelConfig from reference GPTConfig fields and its model file (e.g. 'model/mlra_4_gated.py')."""
    stem, options = PurePosixPath(reference_model).stem, {}
    for suffix, option in _SUFFIXES.items():
        if stem.endswith(suffix):
            stem, options = stem.removesuffix(suffix), options | option
    if stem not in _FILE_VARIANTS:
        raise ConfigError(f"reference model file {reference_model!r} is not one of the paper's variants "
                          f"({', '.join(f'model/{f}.py' for f in _FILE_VARIANTS)}, with _gated, _no_scale or "
                          f"_normal_initialization)")
    kwargs = {_FIELDS[k]: v for k, v in fields.items() if k in _FIELDS}
    variant = _FILE_VARIANTS[stem]
    if variant == "gqa" and kwargs.get("group_size") == kwargs.get("n_head"):
        variant = "mqa"  # the reference runs MQA through gqa.py with group_size = n_head
    if "group_size" not in SPECS[variant].required_fields:  # MQA's is implied (n_head): left unset as in ours
        kwargs.pop("group_size", None)
    return ModelConfig(variant=variant, **kwargs, **options, **overrides)


def reference_config(cfg: ModelConfig) -> tuple[dict[str, Any], str]:
    """(reference GPTConfig fields, reference model file) for a ModelConfig."""
    ref_names = {ours: ref for ref, ours in _FIELDS.items() if ref != "share_q_dim"}
    if cfg.variant == "mfa":
        ref_names["q_lora_rank"] = "share_q_dim"
    fields = {ref_names[f.name]: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name in ref_names and getattr(cfg, f.name) is not None}
    if cfg.variant == "mqa":
        fields["group_size"] = cfg.n_head
    suffix = "".join(s for s, option in _SUFFIXES.items()
                     if all(getattr(cfg, k) == v for k, v in option.items()))
    return fields, f"model/{cfg.spec.reference_stem}{suffix}.py"
