"""Small runs of every variant that train on a laptop CPU in a few minutes.

Each keeps its variant's shape ratios at d = 128 with 4 layers and 4 heads, the
GPT-2 vocabulary, and a short, hot version of the paper's schedule.
"""

from __future__ import annotations

from typing import Any

from mlra_jax.experiments.registry import register

from mlra_jax.config import CheckpointConfig, DataConfig, Experiment, ModelConfig, TrainConfig
from mlra_jax.variants import SPECS

_LATENT = dict(q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16)
_ATTENTION: dict[str, dict[str, Any]] = {
    "mha": dict(head_dim=32),
    "mqa": dict(head_dim=32),
    "gqa": dict(head_dim=32, group_size=2),
    "mla": _LATENT,
    "mfa": dict(head_dim=64, q_lora_rank=96),
    "tpa": dict(head_dim=32, tpa_rank=2, tpa_q_rank=4),
    "gla2": _LATENT,
    "gla4": _LATENT,
    "gta": dict(head_dim=32, group_size=2),
    "mlra2": _LATENT,
    "mlra4": _LATENT,
}
TINY_TRAIN = TrainConfig(
    seq_len=128,
    global_batch_size=8,
    total_steps=200,
    warmup_steps=0.1,
    peak_lr=3e-3,
    seed=0,
    log_every=10,
    eval_every=100,
    eval_batches=4,
)


def tiny_model(variant: str, **changes: Any) -> ModelConfig:
    fields = dict(
        n_layer=4, n_head=4, n_embd=128, intermediate_size=384, vocab_size=50304, max_seq_len=512, **_ATTENTION[variant]
    )
    return ModelConfig(variant=variant, **{**fields, **changes})


for _v in _ATTENTION:
    register(
        Experiment(
            name=f"{_v}_tiny",
            description=f"{SPECS[_v].display_name}, 4 layers, d=128: trains on a CPU in minutes on the built-in corpus",
            model=tiny_model(_v),
            train=TINY_TRAIN,
            data=DataConfig(dataset="builtin"),
            checkpoint=CheckpointConfig(every=100, keep=2),
        )
    )
