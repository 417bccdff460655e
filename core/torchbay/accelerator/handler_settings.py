"""Kwargs handlers that carry config settings (a plugin's handler standing for one of Accelerate's nested configs,
e.g. ``TERecipeKwargs`` for ``fp8_config``): what the Accelerator reads from them before resolving its config."""

from __future__ import annotations

from typing import Any, Iterable

from torchbay.errors import ConfigError


def settings_of_handlers(handlers: Iterable[Any], pm) -> dict[str, tuple[Any, str]]:
    """Config settings that kwargs handlers carry (a plugin's handler standing for one of Accelerate's nested
    configs, e.g. ``TERecipeKwargs`` for ``fp8_config``): ``{dotted key: (value, source label)}``."""
    out: dict[str, tuple[Any, str]] = {}
    for handler in handlers:
        if getattr(handler, "accelerate_section", None):
            from torchbay.compat.config_import import handler_settings  # the Accelerate tables: only when asked

            out.update(handler_settings(handler, pm))
    return out


def check_handler_modes(handlers: Iterable[Any], mode: str) -> None:
    """A handler that only means something in some ``mixed_precision`` modes, given in another one."""
    for handler in handlers:
        modes = getattr(handler, "needs_mixed_precision", None)
        if modes and mode not in modes:
            raise ConfigError(f"kwargs_handlers: {type(handler).__name__} configures mixed_precision "
                              f"{' or '.join(repr(m) for m in modes)}, but mixed_precision is {mode!r}; pass "
                              f"mixed_precision={modes[0]!r} (or set it in the config), or drop the handler")
