"""Benchmark settings: the paper's decoding-throughput study (Sec. 5, Decoding Throughput).

DeepSeek-V3's attention shape (128 heads of 128, hidden 7168, d_c' = 1536, d_c = 512,
d_h^R = 64; GQA with g = 16 KV heads), batch 128, 1K-16K tokens, one decode step of
the attention layer (its projections and the attention) per measurement, on 8 GPUs:
GQA at TP=8, MLA at DP=8, GLA-2 at TP=2 x DP=4, MLRA-4 at TP=4 x DP=2. On fewer GPUs
the same TP degrees are kept (capped at the device count) and DP takes the rest, with
the batch scaled to keep the sequences per data-parallel group.
"""

from __future__ import annotations

from mlra_jax.config import ModelConfig

_LATENT = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64)
_COMMON = dict(
    n_layer=1,
    n_head=128,
    n_embd=7168,
    intermediate_size=128,
    vocab_size=128,
    max_seq_len=32768,
    param_dtype="bfloat16",
    compute_dtype="bfloat16",
)
THROUGHPUT_MODELS = {
    "gqa": ModelConfig(variant="gqa", head_dim=128, group_size=8, **_COMMON),
    "mla": ModelConfig(variant="mla", **_LATENT, **_COMMON),
    "gla2": ModelConfig(variant="gla2", **_LATENT, **_COMMON),
    "mlra4": ModelConfig(variant="mlra4", **_LATENT, **_COMMON),
}
# TP degree of each variant in the paper's 8-GPU deployment (DP takes the other devices)
PAPER_TP = {"gqa": 8, "mla": 1, "gla2": 2, "mlra4": 4}
PAPER_GPUS, PAPER_BATCH = 8, 128
THROUGHPUT_CONTEXTS = (1024, 2048, 4096, 8192, 16384)


def deployment(variant: str, devices: int) -> tuple[int, int, int]:
    """(TP, DP, global batch) on `devices` GPUs, scaled from the paper's 8-GPU setting."""
    tp = min(PAPER_TP[variant], devices)
    return tp, devices // tp, PAPER_BATCH * devices // PAPER_GPUS
