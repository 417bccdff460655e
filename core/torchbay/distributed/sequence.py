"""Checks on a model before its sequence is sharded across ranks (Accelerate's sequence parallelism; torchbay's
context parallelism shards the sequence the same way)."""

from __future__ import annotations

from typing import Any

from torchbay.errors import ConfigError


def recurrent_layer_types(model: Any) -> list[str]:
    """The model's layer types (``config.layer_types``, of the text config where there is one) that carry a state
    along the sequence (linear attention)."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    return sorted({kind for kind in layer_types if "linear_attention" in str(kind)})


def refuse_recurrent_layers(model: Any) -> None:
    """Refuse a model with linear-attention layers before its sequence is sharded: such a layer carries a recurrent
    state along the sequence inside the model's own code, so each rank would restart that state from zero and the
    gradients would be wrong without any error."""
    recurrent = recurrent_layer_types(model)
    if recurrent:
        raise ConfigError(f"Sequence parallelism does not support attention layers of type {recurrent} (model "
                          f"{type(model).__name__}): they carry a recurrent state along the sequence, which "
                          f"sharding the sequence would restart on every rank; use a full-attention model, or "
                          f"leave the sequence unsharded (cp_size/sp_size 1)")
