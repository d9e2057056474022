"""Which of our configs a reference checkpoint is: from its config.json fields and its tensor names and shapes."""

from __future__ import annotations

from typing import Any, Mapping

from mlra_jax.config import ConfigError, ModelConfig
from mlra_jax.interop.names import LAYER_PREFIX, TIED_KEY, TOP_RULES, layer_rules
from mlra_jax.interop.reference_config import OFFICIAL_MODEL_FILES, config_from_reference
from mlra_jax.interop.state_dict import guess_variant, reference_shapes
from mlra_jax.variants import SPECS

# the official model files that tensor names can tell apart (the other options change no name)
_FILES = tuple(sorted(f for f in OFFICIAL_MODEL_FILES if not f.endswith(("_no_scale.py", "_normal_initialization.py"))))


def _names(cfg: ModelConfig) -> set[str]:
    names = {ref for rule in TOP_RULES for ref in rule.refs}
    for i in range(cfg.n_layer):
        names |= {LAYER_PREFIX.format(i=i) + ref for rule in layer_rules(cfg) for ref in rule.refs}
    return names


def _fits(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    if set(shapes) - {TIED_KEY} != _names(cfg):
        return False  # the names alone rule it out; shapes (which need the model traced) only for the rest
    expected = reference_shapes(cfg)
    return (
        set(shapes) <= set(expected)
        and all(expected[k] == s for k, s in shapes.items())
        and set(expected) - set(shapes) <= {"lm_head.weight"}
    )


def detect_config(
    shapes: Mapping[str, tuple[int, ...]],
    fields: Mapping[str, Any],
    reference_model: str | None = None,
    variant: str | None = None,
) -> ModelConfig:
    """Our ModelConfig for a reference state_dict of these tensor shapes and GPTConfig `fields`.

    `variant` is one of ours (mla) or a reference model file (model/mla_no_scale.py); `reference_model`
    is the file a config.json names. Without either, the files whose names and shapes fit are tried;
    a ConfigError asks for --variant when several fit. With one of them given, the config is built even
    if it does not fit, so that loading names what differs."""
    if reference_model is not None and not isinstance(reference_model, str):
        raise ConfigError(
            f"config.json's reference_model is {reference_model!r}, not the name of an official model "
            f"file (a string such as 'model/mlra_4.py'); correct it, or remove it and pass --variant"
        )
    if variant is not None and variant.endswith(".py"):
        reference_model, variant = variant, None
    if variant is not None and variant not in SPECS:
        raise ConfigError(f"--variant {variant!r} is none of {', '.join(SPECS)} (or a reference file model/NAME.py)")
    if reference_model is not None and variant is None:
        return config_from_reference(fields, reference_model)
    candidates = []
    for file in _FILES:
        try:
            cfg = config_from_reference(fields, file)
        except (ConfigError, TypeError, ValueError):
            continue  # this file's config does not take these fields
        if variant is None or cfg.variant == variant:
            candidates.append(cfg)
    fitting = [cfg for cfg in candidates if _fits(cfg, shapes)]
    if len(fitting) == 1:
        return fitting[0]
    if variant is not None:
        if candidates:
            return (fitting or candidates)[0]  # several: the ungated one; none: loading says what differs
        raise ConfigError(
            f"--variant {variant} does not fit this checkpoint: its config.json fields make no "
            f"{variant} config, and its tensors look like {guess_variant(set(shapes))}"
        )
    if not fitting:
        raise ConfigError(
            f"the tensor names and shapes fit none of the paper's variants with these config.json "
            f"fields; they look like {guess_variant(set(shapes))}. Pass --variant"
        )
    names = ", ".join(f"{c.variant}{' (gated)' if c.gated else ''}" for c in fitting)
    raise ConfigError(f"the tensor names cannot tell which variant this is ({names} fit); pass --variant")
