"""MLRAForCausalLM: mlra_jax models in PyTorch for Hugging Face transformers (all 11 attention variants).

Copied into every folder that `mlra convert to-hf` writes and loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`; it imports nothing of mlra_jax.
It computes what mlra_jax's JAX modules compute (mlra_jax/model.py, layers.py, attention/*.py) under
the official PyTorch code's tensor names (transformer.h.{i}.attn.c_q.weight, ...), so the weights are
the official state_dict and the logits match the JAX model's (float32: within 1e-4).

KV cache (transformers' `Cache` API, a `DynamicCache` by default): each layer caches what the paper
says the variant caches, packed as the cache's (keys, values) pair of [batch, units, tokens, width]:
GQA/MHA/MQA/MFA their K and V heads; MLA, GLA and MLRA the normalized, scaled latent blocks and the
one RoPE key; GTA the tied KV heads and the RoPE key; TPA its factors (A_k with B_k, A_v with B_v).
Every step up-projects the per-head keys and values from the cached entries; it does not absorb the
up-projections into the query as mlra_jax's JAX Generator does for decode steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mlra import MLRAConfig

# (latent blocks, branches) of the latent family (mlra_jax/variants.py)
LATENT_LAYOUTS = {"mla": (1, 1), "gla2": (2, 1), "gla4": (4, 1), "mlra2": (4, 2), "mlra4": (4, 4)}
KV_HEADS = {"mha": lambda c: c.n_head, "mqa": lambda c: 1, "gqa": lambda c: c.n_head // c.group_size}
# The output's cache field: `cache` from transformers 5.24 (which warns at the old name), `past_key_values` before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split RoPE on the last axis of x [B, T, ..., D] at positions [B, T], computed in float32."""
    width = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, width, 2, dtype=torch.float32, device=x.device) / width))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.to(torch.float32).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, Dk] over k [B, Hkv, S, Dk], v [B, Hkv, S, Dv] under mask [B, T, S] -> [B, T, Hq, Dv].
    Query head i reads KV head i // (Hq / Hkv)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != k.shape[1]
    )
    return out.transpose(1, 2)


class RMSNorm(nn.Module):
    """In float32, cast back to the input dtype, times the weight (the reference's RMSNorm)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def linear(n_in: int, n_out: int, init_as: str | float = "normal") -> nn.Linear:
    """A bias-free Linear; `init_as` (read by _init_weights): "normal", "output" (zero or normal by the config's
    output_init) or a float, the bound of a uniform draw (TPA's xavier-uniform)."""
    layer = nn.Linear(n_in, n_out, bias=False)
    layer.init_as = init_as
    return layer


class Attention(nn.Module):
    """The shared part: the optional sigmoid gate and the output projection c_proj. A variant defines
    `entry` (what it caches for new tokens) and `attend` (the heads' output over cached entries)."""

    gate_name = "gated_proj"  # the gate's name in the official files (gqa_gated.py names it c_gated)

    def __init__(self, config: MLRAConfig, value_dim: int):
        super().__init__()
        self.config, self.n_head, self.value_dim = config, config.n_head, value_dim
        self.c_proj = linear(config.n_head * value_dim, config.n_embd, init_as="output")
        if config.gated:
            setattr(self, self.gate_name, linear(config.n_embd, config.n_head * value_dim))

    def entry(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(
        self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Cache | None, layer: int
    ) -> torch.Tensor:
        keys, values = self.entry(x, positions)
        if cache is not None:
            keys, values = cache.update(keys, values, layer)
        heads = self.attend(x, positions, keys, values, mask).reshape(x.shape[0], x.shape[1], -1).to(x.dtype)
        if self.config.gated:
            heads = heads * torch.sigmoid(getattr(self, self.gate_name)(x))
        return self.c_proj(heads)


class GroupedQueryAttention(Attention):
    """MHA, MQA, GQA: RoPE on the whole head; caches K and V per KV head."""

    gate_name = "c_gated"

    def __init__(self, config: MLRAConfig):
        super().__init__(config, config.head_dim)
        self.kv_heads, self.head_dim = KV_HEADS[config.variant](config), config.head_dim
        self.c_q = linear(config.n_embd, config.n_head * config.head_dim)
        self.c_k = linear(config.n_embd, self.kv_heads * config.head_dim)
        self.c_v = linear(config.n_embd, self.kv_heads * config.head_dim)

    def entry(self, x, positions):
        b, t, _ = x.shape
        k = apply_rope(self.c_k(x).view(b, t, self.kv_heads, self.head_dim), positions, self.config.rope_theta)
        return k.transpose(1, 2), self.c_v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)

    def attend(self, x, positions, keys, values, mask):
        q = apply_rope(self.c_q(x).view(*x.shape[:2], self.n_head, self.head_dim), positions, self.config.rope_theta)
        return attention(q, keys, values, self.head_dim**-0.5, mask)


class MultiMatrixFactorizationAttention(Attention):
    """MFA: a low-rank RMS-normalized query path to h heads over one shared K and V head."""

    def __init__(self, config: MLRAConfig):
        super().__init__(config, config.head_dim)
        d, dq, dh = config.n_embd, config.q_lora_rank, config.head_dim
        self.head_dim = dh
        self.c_q = linear(d, dq)
        self.q_layernorm = RMSNorm(dq, config.norm_eps)
        self.w_q = linear(dq, config.n_head * dh)
        self.c_k = linear(d, dh)
        self.c_v = linear(d, dh)

    def entry(self, x, positions):
        b, t, _ = x.shape
        k = apply_rope(self.c_k(x).view(b, t, 1, self.head_dim), positions, self.config.rope_theta)
        return k.transpose(1, 2), self.c_v(x).view(b, t, 1, self.head_dim).transpose(1, 2)

    def attend(self, x, positions, keys, values, mask):
        q = self.w_q(self.q_layernorm(self.c_q(x))).view(*x.shape[:2], self.n_head, self.head_dim)
        return attention(apply_rope(q, positions, self.config.rope_theta), keys, values, self.head_dim**-0.5, mask)


class TPAFactors(nn.Module):
    """TPA's six factor projections (the reference's c_qkv module)."""

    def __init__(self, config: MLRAConfig):
        super().__init__()
        d, h, dh, r, rq = config.n_embd, config.n_head, config.head_dim, config.tpa_rank, config.tpa_q_rank
        # each weight's 3-D view (in, heads, rank) or (in, rank, d_h), on which the reference draws xavier-uniform
        views = {
            "W_A_q": (d, h, rq),
            "W_A_k": (d, h, r),
            "W_A_v": (d, h, r),
            "W_B_q": (d, rq, dh),
            "W_B_k": (d, r, dh),
            "W_B_v": (d, r, dh),
        }
        for name, (n_in, rows, width) in views.items():
            bound = math.sqrt(6.0 / (rows * width + n_in * width))  # torch's fans of the 3-D view
            setattr(self, name, linear(n_in, rows * width, init_as=bound))


class TensorProductAttention(Attention):
    """TPA: every head's q, k, v is A [h, rank] times B [rank, d_h] / rank; RoPE on B_q and B_k.
    Caches (A_k, B_k) as keys and (A_v, B_v) as values, each flattened into one row per token."""

    def __init__(self, config: MLRAConfig):
        super().__init__(config, config.head_dim)
        self.c_qkv = TPAFactors(config)
        self.head_dim, self.rank, self.q_rank = config.head_dim, config.tpa_rank, config.tpa_q_rank

    def _pack(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a.flatten(2), b.flatten(2)], dim=-1)[:, None]

    def _product(self, packed: torch.Tensor) -> torch.Tensor:
        """[B, 1, S, h r + r d_h] -> [B, h, S, d_h]."""
        b, _, s, _ = packed.shape
        a, f = packed[:, 0].split([self.n_head * self.rank, self.rank * self.head_dim], dim=-1)
        a, f = a.view(b, s, self.n_head, self.rank), f.view(b, s, self.rank, self.head_dim)
        return torch.einsum("bshr,bsrk->bhsk", a, f) / self.rank

    def entry(self, x, positions):
        b, t, _ = x.shape
        qkv, h, r, dh = self.c_qkv, self.n_head, self.rank, self.head_dim
        b_k = apply_rope(qkv.W_B_k(x).view(b, t, r, dh), positions, self.config.rope_theta)
        return (
            self._pack(qkv.W_A_k(x).view(b, t, h, r), b_k),
            self._pack(qkv.W_A_v(x).view(b, t, h, r), qkv.W_B_v(x).view(b, t, r, dh)),
        )

    def attend(self, x, positions, keys, values, mask):
        b, t, _ = x.shape
        a_q = self.c_qkv.W_A_q(x).view(b, t, self.n_head, self.q_rank)
        b_q = apply_rope(self.c_qkv.W_B_q(x).view(b, t, self.q_rank, self.head_dim), positions, self.config.rope_theta)
        q = torch.einsum("bthr,btrk->bthk", a_q, b_q) / self.q_rank
        return attention(q, self._product(keys), self._product(values), self.head_dim**-0.5, mask)


class GroupedTiedAttention(Attention):
    """GTA: grouped KV heads whose first half is both key and value, plus one shared RoPE key of d_h/2."""

    def __init__(self, config: MLRAConfig):
        super().__init__(config, config.head_dim)
        d, dh = config.n_embd, config.head_dim
        self.kv_heads, self.head_dim, self.half = config.n_head // config.group_size, dh, dh // 2
        self.c_q = linear(d, config.n_head * dh)
        self.kv_proj = linear(d, self.kv_heads * dh)
        self.W_rope_k = linear(d, dh // 2)

    def entry(self, x, positions):
        b, t, _ = x.shape
        k_rope = apply_rope(self.W_rope_k(x).view(b, t, 1, self.half), positions, self.config.rope_theta)
        return self.kv_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), k_rope.transpose(1, 2)

    def attend(self, x, positions, keys, values, mask):
        q = self.c_q(x).view(*x.shape[:2], self.n_head, self.head_dim)
        q = torch.cat([q[..., : self.half], apply_rope(q[..., self.half :], positions, self.config.rope_theta)], -1)
        tied = keys[..., : self.half]
        k = torch.cat([tied, values.expand(tied.shape)], dim=-1)
        return attention(q, k, keys, self.head_dim**-0.5, mask)


class LatentAttention(Attention):
    """MLA, GLA-2, GLA-4, MLRA-2, MLRA-4: MLA's query path and one down-projection to d_c latent channels
    in `blocks` blocks plus a shared RoPE key. Block b (RMSNorm and up-projection of its own) serves the
    heads of group b % (blocks / branches) in branch b // (blocks / branches); the branches' attention
    outputs are summed and scaled by 1/sqrt(branches). Caches the normalized, scaled latent blocks."""

    def __init__(self, config: MLRAConfig):
        super().__init__(config, config.qk_nope_head_dim)
        d, h, dq, dc = config.n_embd, config.n_head, config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.blocks, self.branches = LATENT_LAYOUTS[config.variant]
        self.block_rank, self.block_heads = dc // self.blocks, h * self.branches // self.blocks
        self.q_a_proj = linear(d, dq)
        self.q_a_layernorm = RMSNorm(dq, config.norm_eps)
        self.q_b_proj = linear(dq, h * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = linear(d, dc + self.rope)
        up_width = self.block_heads * 2 * self.nope
        if config.variant == "mla":
            self.kv_a_layernorm = RMSNorm(dc, config.norm_eps)
            self.kv_b_proj = linear(dc, up_width)
        elif config.variant == "gla2":
            self.kv_a_layernorm_1 = RMSNorm(self.block_rank, config.norm_eps)
            self.kv_a_layernorm_2 = RMSNorm(self.block_rank, config.norm_eps)
            self.kv_b_proj_1 = linear(self.block_rank, up_width)
            self.kv_b_proj_2 = linear(self.block_rank, up_width)
        else:  # a raw [blocks, rank, heads * 2 d_h] parameter, as the official gla_4.py and mlra_*.py
            self.kv_a_layernorms = nn.ModuleList(RMSNorm(self.block_rank, config.norm_eps) for _ in range(self.blocks))
            self.kv_b_proj = nn.Parameter(torch.empty(self.blocks, self.block_rank, up_width))
        self.q_scale = math.sqrt(d / dq) if config.latent_scale else 1.0
        self.kv_scale = math.sqrt(d / self.block_rank) if config.latent_scale else 1.0
        self.branch_scale = self.branches**-0.5 if config.latent_scale else 1.0
        self.softmax_scale = (self.nope + self.rope) ** -0.5

    def block_norms(self) -> list[RMSNorm]:
        if self.config.variant == "mla":
            return [self.kv_a_layernorm]
        if self.config.variant == "gla2":
            return [self.kv_a_layernorm_1, self.kv_a_layernorm_2]
        return list(self.kv_a_layernorms)

    def kv_up(self) -> torch.Tensor:
        """[blocks, rank, heads per block, 2 d_h]: per head k_nope then v."""
        if self.config.variant == "mla":
            up = self.kv_b_proj.weight.T[None]
        elif self.config.variant == "gla2":
            up = torch.stack([self.kv_b_proj_1.weight.T, self.kv_b_proj_2.weight.T])
        else:
            up = self.kv_b_proj
        return up.reshape(self.blocks, self.block_rank, self.block_heads, 2 * self.nope)

    def entry(self, x, positions):
        b, t, _ = x.shape
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.blocks * self.block_rank, self.rope], dim=-1)
        latent = latent.view(b, t, self.blocks, self.block_rank)
        latent = torch.stack([norm(latent[:, :, j]) for j, norm in enumerate(self.block_norms())], dim=1)
        k_rope = apply_rope(k_rope.view(b, t, 1, self.rope), positions, self.config.rope_theta)
        return (latent * self.kv_scale).to(x.dtype), k_rope.transpose(1, 2)

    def per_block(self, q: torch.Tensor) -> torch.Tensor:
        """[B, T, h, D] -> [B, T, blocks * heads per block, D]: the heads each block serves, block by block."""
        b, t, _, dim = q.shape
        groups = self.blocks // self.branches
        q = q.reshape(b, t, 1, groups, self.block_heads, dim).expand(b, t, self.branches, groups, self.block_heads, dim)
        return q.reshape(b, t, self.blocks * self.block_heads, dim)

    def attend(self, x, positions, keys, values, mask):
        b, t, _ = x.shape
        c_q = (self.q_a_layernorm(self.q_a_proj(x)) * self.q_scale).to(x.dtype)
        q = self.q_b_proj(c_q).view(b, t, self.n_head, self.nope + self.rope)
        q = torch.cat([q[..., : self.nope], apply_rope(q[..., self.nope :], positions, self.config.rope_theta)], -1)
        up = self.kv_up().to(keys.dtype)
        k_nope = torch.einsum("bnsr,nrhk->bnhsk", keys, up[..., : self.nope])
        v = torch.einsum("bnsr,nrhk->bnhsk", keys, up[..., self.nope :])
        k = torch.cat([k_nope, values[:, :, None].expand(k_nope.shape[:-1] + (self.rope,))], dim=-1)
        flat = lambda a: a.reshape(b, self.blocks * self.block_heads, *a.shape[3:])  # noqa: E731
        out = attention(self.per_block(q), flat(k), flat(v), self.softmax_scale, mask)
        out = out.reshape(b, t, self.branches, self.n_head, self.nope).to(torch.float32).sum(dim=2)
        return out * self.branch_scale


ATTENTION = {
    "mha": GroupedQueryAttention,
    "mqa": GroupedQueryAttention,
    "gqa": GroupedQueryAttention,
    "mfa": MultiMatrixFactorizationAttention,
    "tpa": TensorProductAttention,
    "gta": GroupedTiedAttention,
    **{name: LatentAttention for name in LATENT_LAYOUTS},
}


class MLP(nn.Module):
    """SwiGLU: c_proj(silu(c_fc1(x)) * c_fc2(x))."""

    def __init__(self, config: MLRAConfig):
        super().__init__()
        self.c_fc1 = linear(config.n_embd, config.intermediate_size)
        self.c_fc2 = linear(config.n_embd, config.intermediate_size)
        self.c_proj = linear(config.intermediate_size, config.n_embd, init_as="output")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class MLRABlock(nn.Module):
    def __init__(self, config: MLRAConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = ATTENTION[config.variant](config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Cache | None, layer: int
    ) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x), positions, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class MLRAPreTrainedModel(PreTrainedModel):
    config_class = MLRAConfig
    base_model_prefix = "mlra"  # no base-model attribute: the causal LM is the one model
    _no_split_modules = ["MLRABlock"]
    _skip_keys_device_placement = ["cache", "past_key_values"]

    def _init_weights(self, module: nn.Module) -> None:
        """The reference's initialization: N(0, init_std), RMSNorm ones, the two output projections zero
        (output_init="zero") or N(0, init_std), TPA's factors xavier-uniform on their 3-D views. transformers
        calls it per module whose own parameters are not loaded from a checkpoint."""
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            init_as = getattr(module, "init_as", "normal")
            if init_as == "output" and self.config.output_init == "zero":
                init.zeros_(module.weight)
            elif isinstance(init_as, float):
                init.uniform_(module.weight, -init_as, init_as)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, LatentAttention) and isinstance(module.kv_b_proj, nn.Parameter):
            init.normal_(module.kv_b_proj, mean=0.0, std=std)


class MLRAForCausalLM(MLRAPreTrainedModel, GenerationMixin):
    """The decoder with its tied head, under the official code's names: transformer.wte, transformer.h.{i},
    layernorm, lm_head (tied to transformer.wte)."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: MLRAConfig):
        config.check_complete()
        super().__init__(config)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "h": nn.ModuleList(MLRABlock(config) for _ in range(config.n_layer)),
            }
        )
        self.layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = linear(config.n_embd, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer["wte"]

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer["wte"] = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """attention_mask: [B, past + T] with 0 at (left) padding; position_ids [B, T] (default: each row counts
        from the cache's length). Padded keys are never attended to. The KV cache comes as `cache` (transformers
        5.24 and later, which pass that name) or `past_key_values` (earlier ones)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the KV cache as cache or as past_key_values, not both")
        past_key_values = cache if cache is not None else past_key_values
        x = self.transformer["wte"](input_ids) if inputs_embeds is None else inputs_embeds
        batch, length = x.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=x.device)[None]
        positions = position_ids.expand(batch, length)
        mask = self._mask(attention_mask, batch, past, length, x.device)
        layer_cache = past_key_values if use_cache else None
        for layer, block in enumerate(self.transformer["h"]):
            x = block(x, positions, mask, layer_cache, layer)
        hidden = self.layernorm(x)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **{_CACHE_FIELD: past_key_values if use_cache else None}
        )

    @staticmethod
    def _mask(
        attention_mask: torch.Tensor | None, batch: int, past: int, length: int, device: torch.device
    ) -> torch.Tensor:
        """[B, T, past + T] bool: causal, padded keys hidden; a padded query sees itself (no empty softmax row)."""
        total = past + length
        query, key = torch.arange(past, total, device=device), torch.arange(total, device=device)
        causal = key[None, :] <= query[:, None]
        if attention_mask is None:
            return causal[None].expand(batch, length, total)
        if attention_mask.ndim != 2 or attention_mask.shape[-1] != total:
            raise ValueError(
                f"attention_mask must be [batch, past + new tokens] = [{batch}, {total}] (0 at padding); "
                f"got {tuple(attention_mask.shape)}"
            )
        valid = attention_mask.to(device=device, dtype=torch.bool)
        return (causal[None] & valid[:, None, :]) | (key[None, :] == query[:, None])[None]
