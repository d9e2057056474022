"""The paper's 30 pretraining runs at 2.9B (App. F; reference config/*.py).

Every run shares 24 layers, d = 3072, GPT-2's padded vocabulary and the paper's training
recipe (TrainConfig's defaults; docs/conventions.md); the FFN width keeps each variant
at the MHA baseline's parameter count. `reference_key` is the run's key in the table of
the paper's experiments that tests/reference/paper_experiments.json holds.
"""

from __future__ import annotations

from typing import Any

from mlra_jax.experiments.registry import register

from mlra_jax.config import Experiment, MeshConfig, ModelConfig, TrainConfig
from mlra_jax.variants import SPECS

# Layers unrolled (scanning them costs a stacked-activation copy per layer on GPUs) and the least remat that
# fits the device's memory (training.remat_choice): the fastest measured on an H100 (experiments/results/README.md).
_COMMON = dict(
    n_layer=24,
    n_head=24,
    n_embd=3072,
    vocab_size=50304,
    max_seq_len=2048,
    compute_dtype="bfloat16",
    remat="auto",
    scan_layers=False,
)
# 480 sequences per step, accumulated in micro-batches of at most 8 sequences per data-parallel device (the
# fastest that fits, measured); weights and optimizer state sharded over all devices (FSDP).
_TRAIN = TrainConfig(max_micro_batch_per_device=8)
_MESH = MeshConfig(data=1, fsdp=-1, tensor=1)
_LATENT = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64)

# variant -> (attention fields, FFN width) of the main runs
_MAIN: dict[str, tuple[dict[str, Any], int]] = {
    "mha": (dict(head_dim=128), 8192),
    "mqa": (dict(head_dim=128), 10152),
    "gqa": (dict(head_dim=128, group_size=4), 9728),
    "mla": (dict(q_lora_rank=1536, **_LATENT), 9448),
    "mfa": (dict(head_dim=256, q_lora_rank=2048), 8024),
    "tpa": (dict(head_dim=128, tpa_rank=2, tpa_q_rank=6), 10760),
    "gla2": (dict(q_lora_rank=1024, **_LATENT), 10048),
    "gla4": (dict(q_lora_rank=1024, **_LATENT), 10136),
    "gta": (dict(head_dim=128, group_size=4), 9960),
    "mlra2": (dict(q_lora_rank=1024, **_LATENT), 10048),
    "mlra4": (dict(q_lora_rank=1024, **_LATENT), 9880),
}


def _model(variant: str, intermediate_size: int | None = None, **changes: Any) -> ModelConfig:
    fields, ffn = _MAIN[variant]
    return ModelConfig(variant=variant, intermediate_size=intermediate_size or ffn, **{**_COMMON, **fields, **changes})


def _add(name: str, description: str, model: ModelConfig, reference_key: str) -> None:
    register(
        Experiment(
            name=name, description=description, model=model, train=_TRAIN, mesh=_MESH, reference_key=reference_key
        )
    )


def _ref(variant: str) -> str:
    return SPECS[variant].reference_name


def _name(variant: str) -> str:
    return SPECS[variant].display_name


for _v in _MAIN:
    _add(f"{_v}_2p9b", f"{_name(_v)} 2.9B, main results (Tables 3-4)", _model(_v), _ref(_v))

for _v, _ffn, _changes in (("gqa", 7680, dict(group_size=8)), ("mla", 7320, {}), ("gla2", 8344, {})):
    _add(
        f"{_v}_double_heads_2p9b",
        f"{_name(_v)} 2.9B with 48 heads, same KV cache (double-heads ablation)",
        _model(_v, _ffn, n_head=48, **_changes),
        f"{_ref(_v)}_double_heads",
    )

for _v in ("gla2", "gqa", "gta", "mfa", "mha", "mla", "mqa", "tpa"):
    _add(
        f"{_v}_normal_init_2p9b",
        f"{_name(_v)} 2.9B with N(0, 0.02) output projections (initialization ablation)",
        _model(_v, output_init="normal"),
        f"{_ref(_v)}_normal_initialization",
    )

for _v in ("gla2", "mla", "mlra2"):
    _add(
        f"{_v}_no_scale_2p9b",
        f"{_name(_v)} 2.9B without the latent scaling (scaling ablation)",
        _model(_v, latent_scale=False),
        f"{_ref(_v)}_no_scale_xxl",
    )

for _v, _ffn in (("gla2", 9024), ("gqa", 8704), ("mla", 8424), ("mlra2", 9024), ("mlra4", 8856)):
    _add(
        f"{_v}_gated_2p9b",
        f"{_name(_v)} 2.9B with gated attention (gating study)",
        _model(_v, _ffn, gated=True),
        f"{_ref(_v)}_gated_xxl",
    )
