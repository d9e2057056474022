"""MLRAConfig: the Hugging Face configuration of mlra_jax models (all 11 attention variants).

Written by `mlra convert to-hf` beside the weights and loaded with
`AutoConfig.from_pretrained(DIR, trust_remote_code=True)`. Its fields are mlra_jax's ModelConfig
fields (mlra_jax/config.py); this file imports nothing of mlra_jax.
"""

from __future__ import annotations

from transformers import PretrainedConfig

# variant -> the fields it needs besides the common ones
VARIANT_FIELDS = {
    "mha": ("head_dim",),
    "mqa": ("head_dim",),
    "gqa": ("head_dim", "group_size"),
    "mla": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"),
    "mfa": ("head_dim", "q_lora_rank"),
    "tpa": ("head_dim", "tpa_rank", "tpa_q_rank"),
    "gla2": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"),
    "gla4": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"),
    "gta": ("head_dim", "group_size"),
    "mlra2": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"),
    "mlra4": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"),
}


class MLRAConfig(PretrainedConfig):
    """A Llama-3 decoder (pre-norm, SwiGLU, RoPE, tied embedding) with one of the paper's attention variants.

    variant: mha mqa gqa mla mfa tpa gla2 gla4 gta mlra2 mlra4; gated: sigmoid gate before the output
    projection; latent_scale: the sqrt(d/d_c') and sqrt(d/d_c) latent scales and MLRA's 1/sqrt(branches)
    (False: the no-scale ablation); output_init changes only the initialization of new weights."""

    model_type = "mlra"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "max_seq_len",
        "rms_norm_eps": "norm_eps",
    }

    variant: str = "mlra4"
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 256
    intermediate_size: int = 512
    vocab_size: int = 50304
    head_dim: int | None = None
    group_size: int | None = None  # query heads per KV head (GQA, GTA)
    q_lora_rank: int | None = None  # d_c' (latent family); share_q_dim (MFA)
    kv_lora_rank: int | None = None  # d_c
    qk_nope_head_dim: int | None = None  # d_h of the latent family
    qk_rope_head_dim: int | None = None  # d_h^R
    tpa_rank: int | None = None
    tpa_q_rank: int | None = None
    gated: bool = False
    latent_scale: bool = True
    output_init: str = "zero"
    init_std: float = 0.02
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 2048
    use_cache: bool = True
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        if self.variant not in VARIANT_FIELDS:
            raise ValueError(f"variant={self.variant!r} is none of {', '.join(VARIANT_FIELDS)}")

    def check_complete(self) -> None:
        """A ValueError naming the fields the variant needs and the config lacks. Checked when a model is built,
        not here: transformers also builds a bare MLRAConfig() (to diff against its defaults, when it logs one)."""
        missing = [f for f in VARIANT_FIELDS[self.variant] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"variant {self.variant!r} needs {', '.join(missing)} in config.json")
