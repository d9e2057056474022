"""Hugging Face folders of our models: written by `convert to-hf`, read by `train --init_from=DIR`.

A folder holds `config.json` (model_type "mlra": every ModelConfig field that sets what the model
computes, with `auto_map` to the code beside it), `configuration_mlra.py` and `modeling_mlra.py`
(mlra_jax/hf_remote_code, loaded through `trust_remote_code`), the weights as transformers'
`save_pretrained` writes them (`model.safetensors`, or shards with `model.safetensors.index.json`
above the size limit; the tied head stored once, as `transformer.wte.weight`) under the official
code's tensor names, and the GPT-2 tokenizer (`tokenizer.json`, made offline from the bundled BPE
ranks). torch and transformers are imported inside the functions (the `hf` extra). A folder is used only
whole (`check_hf_folder`: config, code, every weight file and the tokenizer) and with a config.json whose
fields have their types (`model_config_from_hf`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from mlra_jax.config import RUNTIME_FIELDS, ConfigError, ModelConfig
from mlra_jax.data.tokenizer import BPE_FILE, EOT, GPT2_PATTERN
from mlra_jax.hf_remote_code import REMOTE_CODE_FILES
from mlra_jax.interop.files import CONFIG_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX, to_torch

MODEL_TYPE = "mlra"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
AUTO_MAP = {"AutoConfig": "configuration_mlra.MLRAConfig", "AutoModelForCausalLM": "modeling_mlra.MLRAForCausalLM"}
# ModelConfig fields that choose how the JAX model runs or stores its weights, not what it computes
_LOCAL_FIELDS = (*RUNTIME_FIELDS, "param_dtype", "compute_dtype")
END_OF_TEXT = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _transformers() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError:
        raise ConfigError("the Hugging Face export needs torch and transformers: pip install 'mlra_jax[hf]'") from None
    return torch, transformers


def hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a model: every ModelConfig field that sets what it computes."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _LOCAL_FIELDS}


def read_hf_config(folder: Path) -> dict[str, Any] | None:
    """The config.json of an exported folder, None when `folder` is not one (no config.json of model_type mlra)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is not a config.json ({err})") from None
    return config if isinstance(config, dict) and config.get("model_type") == MODEL_TYPE else None


def check_hf_folder(folder: Path, source: str) -> None:
    """A ConfigError naming every file that an exported folder lacks (config.json, the modeling code, each weight
    file of the index, the tokenizer): a folder of an export that stopped before its end is never used."""
    folder = Path(folder)
    wanted = [CONFIG_FILE, *REMOTE_CODE_FILES, *TOKENIZER_FILES]
    if (folder / SAFETENSORS_INDEX).is_file():
        try:
            weight_map = json.loads((folder / SAFETENSORS_INDEX).read_text())["weight_map"]
            wanted += sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(
                f"{source}: {SAFETENSORS_INDEX} is not a shard index ({type(err).__name__}: {err}); "
                f"export the run again with mlra convert to-hf"
            ) from None
    else:
        wanted.append(SAFETENSORS_FILE)
    missing = [name for name in wanted if not isinstance(name, str) or not (folder / name).is_file()]
    if missing:
        raise ConfigError(
            f"{source} is not a complete Hugging Face folder of convert to-hf: it lacks "
            f"{', '.join(map(str, missing[:6]))}{' and more' if len(missing) > 6 else ''} (an export "
            f"that stopped before its end?); export the run again with mlra convert to-hf"
        )


def _has_type(value: Any, annotation: Any) -> bool:
    """Whether a JSON value fits a ModelConfig field's annotation (int, float, bool, str, Literal, X | None)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if typing.get_origin(annotation) is typing.Literal or annotation is str:
        return isinstance(value, str)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, annotation) and not isinstance(value, bool)  # int


def model_config_from_hf(config: Mapping[str, Any], source: str) -> ModelConfig:
    """Our ModelConfig from an exported config.json (ConfigError naming what is wrong)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)} - set(_LOCAL_FIELDS)
    missing = sorted(n for n in ("variant", "n_layer", "n_head", "n_embd", "intermediate_size") if n not in config)
    if missing:
        raise ConfigError(f"{source}/config.json lacks {', '.join(missing)}; it is not a folder of convert to-hf")
    hints = typing.get_type_hints(ModelConfig)
    wrong = [
        f"{k}={v!r} (not {getattr(hints[k], '__name__', str(hints[k]).replace('typing.', ''))})"
        for k, v in config.items()
        if k in names and not _has_type(v, hints[k])
    ]
    if wrong:
        raise ConfigError(
            f"{source}/config.json has fields of the wrong type: {'; '.join(wrong)}; restore the "
            f"values convert to-hf wrote, or export the run again"
        )
    return ModelConfig(**{k: v for k, v in config.items() if k in names})


def hf_step(config: Mapping[str, Any], source: str) -> int:
    """The training step an exported folder's weights come from (config.json's mlra_jax.step; 0 when absent)."""
    record = config.get("mlra_jax") or {}
    step = record.get("step", 0) if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(
            f"{source}/config.json: mlra_jax.step is {step!r}, not a step number (an integer >= 0); "
            f"restore the value convert to-hf wrote, or remove the mlra_jax field"
        )
    return step


@functools.cache
def gpt2_hf_tokenizer(max_len: int) -> Any:
    """GPT-2's tokenizer for transformers, converted from the bundled tiktoken ranks by transformers' own
    TikTokenConverter: the same pre-tokenization pattern and merges, <|endoftext|> (50256) special; no download."""
    _transformers()
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(
        vocab_file=str(BPE_FILE), pattern=GPT2_PATTERN, extra_special_tokens={END_OF_TEXT: EOT}
    ).converted()
    return PreTrainedTokenizerFast(
        tokenizer_object=converted,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        model_max_length=max_len,
    )


def write_hf_folder(
    state_dict: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    out: Path,
    dtype: str,
    shard_size: int,
    source: Mapping[str, Any],
) -> list[str]:
    """Write the folder into the (existing, empty) `out`; the files written.

    The model is built from the copied code as a user loads it (AutoModelForCausalLM with trust_remote_code,
    on the meta device: no weights are initialized), given the reference state_dict and saved by transformers."""
    torch, transformers = _transformers()
    code = resources.files("mlra_jax.hf_remote_code")
    for name in REMOTE_CODE_FILES:
        (out / name).write_text(code.joinpath(name).read_text())
    token = EOT if cfg.vocab_size > EOT else None  # <|endoftext|> starts documents and ends generation
    fields = {
        "model_type": MODEL_TYPE,
        "architectures": ["MLRAForCausalLM"],
        "auto_map": AUTO_MAP,
        **hf_fields(cfg),
        "bos_token_id": token,
        "eos_token_id": token,
    }
    (out / CONFIG_FILE).write_text(json.dumps(fields, indent=2) + "\n")
    config = transformers.AutoConfig.from_pretrained(str(out), trust_remote_code=True)
    torch_dtype = getattr(torch, DTYPES[dtype])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch_dtype)
    tensors = {k: to_torch(v).to(torch_dtype) for k, v in state_dict.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(str(out), max_shard_size=shard_size)
    saved = json.loads((out / CONFIG_FILE).read_text())  # transformers stores only non-default values: add them all
    saved.update(fields, dtype=DTYPES[dtype], mlra_jax=dict(source))
    (out / CONFIG_FILE).write_text(json.dumps(saved, indent=2) + "\n")
    gpt2_hf_tokenizer(cfg.max_seq_len).save_pretrained(str(out))  # tokenizer.json, tokenizer_config.json
    return sorted(p.name for p in out.iterdir())


def push_folder(folder: Path, repo: str) -> str:
    """Upload the folder to the Hub model repository `repo` (created if needed); its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, repo_type="model", exist_ok=True)
    return str(
        api.upload_folder(
            folder_path=str(folder), repo_id=repo, repo_type="model", commit_message="mlra_jax convert to-hf"
        )
    )


def check_repo_id(repo: str) -> None:
    """ConfigError unless `repo` is a valid Hub repository id (checked before anything is written)."""
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        raise ConfigError("--push needs huggingface_hub: pip install 'mlra_jax[hf]'") from None
    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise ConfigError(f"--push {repo!r} is not a Hub repository id (USER/NAME): {err}") from None
