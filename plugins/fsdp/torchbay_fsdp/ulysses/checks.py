"""Sequence-parallel checks that start no process group: the ``parallelism`` section (config time) and a model
(when it is prepared, before any collective runs on it)."""

from __future__ import annotations

from typing import Any

from torchbay.errors import ConfigError
from torchbay.plugin import SP_ATTN_IMPLEMENTATIONS, refuse_recurrent_layers

WHERE = "parallelism"


def check_sequence_parallel(section: Any, sizes: dict[str, int]) -> list[str]:
    """Problems with the sp settings of the ``parallelism`` section."""
    sp = sizes.get("sp", 1)
    problems: list[str] = []
    length = getattr(section, "sp_seq_length", None)
    impl = getattr(section, "sp_attn_implementation", None)
    if sp == 1:
        for name, value in (("sp_seq_length", length), ("sp_attn_implementation", impl)):
            if value is not None:
                problems.append(f"{WHERE}.{name} is set but {WHERE}.sp_size is 1; set sp_size or remove {name}")
        return problems
    if sizes.get("cp", 1) > 1:
        problems.append(f"{WHERE}: cp_size {sizes['cp']} and sp_size {sp} both shard the sequence; set one of them "
                        f"to 1 (docs/parallelism.md: cp or sp)")
    if length is not None and length % sp:
        problems.append(f"{WHERE}.sp_seq_length {length} is not divisible by sp_size {sp}: pad every sequence to a "
                        f"multiple of {sp} (e.g. the collator's pad_to_multiple_of={sp}) and set that length")
    if impl is not None and impl not in SP_ATTN_IMPLEMENTATIONS and not ("/" in impl and "flash-attn" in impl):
        problems.append(f"{WHERE}.sp_attn_implementation {impl!r}: use one of {', '.join(SP_ATTN_IMPLEMENTATIONS)} "
                        f"(or a hub flash-attention kernel), or leave it unset (the model's own)")
    return problems


def text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model: Any, sp: int, tp: int = 1) -> None:
    """Refuse a model whose attention the Ulysses wrapper cannot run at sp size ``sp`` (beside tensor parallel of
    size ``tp``: each tp rank holds ``heads / tp`` heads, which sp splits again), naming the fix."""
    name = type(model).__name__
    config = text_config(model)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ConfigError(f"parallelism.sp_size {sp}: {name} is not a transformers model, so its attention cannot be "
                          f"wrapped through transformers' AttentionInterface; use a transformers model (or "
                          f"context parallelism, cp_size, on an accelerator), or set sp_size 1")
    refuse_recurrent_layers(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads:
        raise ConfigError(f"parallelism.sp_size {sp}: {name}'s config has no num_attention_heads, so its heads "
                          f"cannot be split across the sp group; set sp_size 1")
    split = sp * tp
    sizes = f"sp_size {sp}" if tp == 1 else f"sp_size {sp} x tp_size {tp} = {split}"
    share = ("Ulysses gives each rank of the sp group an equal share of the heads" if tp == 1 else
             f"each tp rank holds heads/{tp} of them and Ulysses splits those again over the sp group")
    for what, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % split:
            fix = (f"choose an sp_size that divides {count} (and the other head count)" if tp == 1 else
                   f"choose sp_size and tp_size whose product divides {count} (and the other head count)")
            raise ConfigError(f"parallelism.sp_size {sp}: {name} has {what} {count}, not divisible by {sizes}: "
                              f"{share}; {fix}, or use cp_size instead")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ConfigError(f"parallelism.sp_size {sp}: {name} uses sliding-window attention, which the Ulysses "
                          f"wrapper does not apply (it runs full causal attention on the gathered sequence); set "
                          f"sp_size 1")
