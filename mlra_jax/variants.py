"""The registry of attention variants: one spec per variant, read by everything that knows variants.

Configuration checks, the attention class, display names, the reference implementation's
names, d_h and the latent layouts all come from `SPECS`. Adding a variant takes its
attention module (mlra_jax/attention/) and one line here. This module imports nothing of
the library: it is the lowest layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

LATENT_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    """What the library knows about one variant."""

    name: str  # ModelConfig.variant
    display_name: str  # as the paper writes it
    attention: str  # "module.Class" of its attention under mlra_jax.attention; the module is its family
    required_fields: tuple[str, ...]  # ModelConfig fields it needs (the only optional ones it accepts)
    reference_name: str  # the reference implementation's name: model/{name}.py, run keys {name}_...
    reference_file: str | None = None  # the reference model file's stem where it is another's (MQA: gqa)
    # (latent blocks, branches) of the latent family: MLA is one block serving every head; GLA-g splits
    # the latent into g blocks, each serving h/g heads; MLRA-4 has four blocks, each serving all heads in
    # its own branch; MLRA-2 has four blocks in two branches, each block serving half of the heads.
    latent_layout: tuple[int, int] | None = None
    kv_heads: Callable[[Any], int] | None = None  # KV heads of a config (variants that have KV heads)
    fixed_group_size: Callable[[int], int] | None = None  # n_head -> the group size it implies (MHA, MQA)
    head_width: int = 1  # head_dim in units of the paper's d_h (MFA's heads are 2 d_h wide)
    half_rope: bool = False  # RoPE on half of each head's channels (GTA)

    @property
    def family(self) -> str:
        """The attention module that implements it: gqa, latent, mfa, tpa or gta."""
        return self.attention.split(".")[0]

    @property
    def reference_stem(self) -> str:
        """The stem of its model file in the reference implementation."""
        return self.reference_file or self.reference_name


_GQA, _LATENT = "gqa.GroupedQueryAttention", "latent.LatentAttention"
_GROUPED = lambda cfg: cfg.n_head // cfg.group_size  # noqa: E731

SPECS: dict[str, VariantSpec] = {
    spec.name: spec
    for spec in (
        VariantSpec(
            "mha", "MHA", _GQA, ("head_dim",), "mha", kv_heads=lambda cfg: cfg.n_head, fixed_group_size=lambda n_head: 1
        ),
        VariantSpec(
            "mqa",
            "MQA",
            _GQA,
            ("head_dim",),
            "mqa",
            reference_file="gqa",
            kv_heads=lambda cfg: 1,
            fixed_group_size=lambda n_head: n_head,
        ),
        VariantSpec("gqa", "GQA", _GQA, ("head_dim", "group_size"), "gqa", kv_heads=_GROUPED),
        VariantSpec("mla", "MLA", _LATENT, LATENT_FIELDS, "mla", latent_layout=(1, 1)),
        VariantSpec(
            "mfa",
            "MFA",
            "mfa.MultiMatrixFactorizationAttention",
            ("head_dim", "q_lora_rank"),
            "mfa",
            kv_heads=lambda cfg: 1,
            head_width=2,
        ),
        VariantSpec("tpa", "TPA", "tpa.TensorProductAttention", ("head_dim", "tpa_rank", "tpa_q_rank"), "tpa"),
        VariantSpec("gla2", "GLA-2", _LATENT, LATENT_FIELDS, "gla_2", latent_layout=(2, 1)),
        VariantSpec("gla4", "GLA-4", _LATENT, LATENT_FIELDS, "gla_4", latent_layout=(4, 1)),
        VariantSpec(
            "gta",
            "GTA",
            "gta.GroupedTiedAttention",
            ("head_dim", "group_size"),
            "gta",
            kv_heads=_GROUPED,
            half_rope=True,
        ),
        VariantSpec("mlra2", "MLRA-2", _LATENT, LATENT_FIELDS, "mlra_2", latent_layout=(4, 2)),
        VariantSpec("mlra4", "MLRA-4", _LATENT, LATENT_FIELDS, "mlra_4", latent_layout=(4, 4)),
    )
}

VARIANTS = tuple(SPECS)  # in the paper's order
LATENT_VARIANTS = tuple(name for name, spec in SPECS.items() if spec.latent_layout)
