"""Moving weights between mlra_jax and the official PyTorch implementation."""

from mlra_jax.interop.state_dict import (
    StateDictError,
    convert_from_reference,
    from_state_dict,
    load_state_dict,
    model_state_dict,
    reference_shapes,
    to_state_dict,
)

__all__ = [
    "StateDictError",
    "convert_from_reference",
    "from_state_dict",
    "load_state_dict",
    "model_state_dict",
    "reference_shapes",
    "to_state_dict",
]
