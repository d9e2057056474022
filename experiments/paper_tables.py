"""The settings of the paper's analysis (Sec. 3.4, Tables 1 and 2).

Qwen3-32B's GQA (64 query heads, g = 8 KV heads, d_h = 128) and Kimi-K2's MLA
(64 heads, d_h^R = 64) with d_c = 4 d_h, TPA with beta_kv = 2, and MFA with its
2 d_h-wide head. Only the attention shapes matter here; the rest is nominal.
"""

from __future__ import annotations

from typing import Any

from mlra_jax.config import ModelConfig

D_H = 128
_LATENT = dict(q_lora_rank=1536, kv_lora_rank=4 * D_H, qk_nope_head_dim=D_H, qk_rope_head_dim=D_H // 2)
_ATTENTION: dict[str, dict[str, Any]] = {
    "mha": dict(head_dim=D_H),
    "mqa": dict(head_dim=D_H),
    "gqa": dict(head_dim=D_H, group_size=8),
    "mla": _LATENT,
    "mfa": dict(head_dim=2 * D_H, q_lora_rank=2048),
    "tpa": dict(head_dim=D_H, tpa_rank=2, tpa_q_rank=6),
    "gla2": _LATENT,
    "gla4": _LATENT,
    "gta": dict(head_dim=D_H, group_size=8),
    "mlra2": _LATENT,
    "mlra4": _LATENT,
}
# Table 1's rows and Table 2's columns, in the paper's order (GLA-4 is in neither).
TABLE_VARIANTS = ("mha", "mqa", "gqa", "mla", "mfa", "tpa", "gla2", "gta", "mlra2", "mlra4")
TP_DEGREES = (1, 2, 4, 8)


def analysis_config(variant: str) -> ModelConfig:
    return ModelConfig(
        variant=variant, n_layer=1, n_head=64, n_embd=7168, intermediate_size=1024, **_ATTENTION[variant]
    )
