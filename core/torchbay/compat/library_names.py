"""Accelerate names the Hugging Face libraries import that torchbay's own modules do not define.

``resolve(name, missing)`` answers from ``resources/library_names.yaml``: Accelerate's constants, the small utilities
below, and placeholders for names a torchbay plugin serves while that plugin is not installed (or refuses). Importing
a placeholder works; building or calling it raises :class:`~torchbay.compat.names.UnsupportedAPIError` with the fix.
Any other name of a published plugin that is not installed is a missing attribute naming the distribution.
"""

from __future__ import annotations

import enum
import functools
import gc
from typing import Any

import torch

from torchbay.compat.helpers import _is_out_of_memory
from torchbay.config.files import read_packaged_yaml
from torchbay.errors import UnsupportedAPIError
from torchbay.process.current import peek
from torchbay.switch import surface
from torchbay.switch.finder import LIBRARY_NAMES


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    return read_packaged_yaml("torchbay", LIBRARY_NAMES)


@functools.lru_cache(maxsize=1)
def _plugin_kinds() -> dict[str, tuple[str, str]]:
    """``{name: (kind, distribution)}`` for the placeholders (the plugin that serves each: ``plugin_hints``)."""
    return {name: (kind, _hinted()[name]) for kind, names in table()["placeholders"].items() for name in names}


def placeholders() -> set[str]:
    return set(_plugin_kinds())


def placeholder(name: str, advice: str) -> Any:
    """A class or function named ``name`` whose use raises with ``advice`` (one object per name and advice)."""
    kind = "class" if _plugin_kinds().get(name, ("functions", ""))[0] == "classes" else "function"
    return surface.placeholder("torchbay.compat.library_names", name, kind, advice,
                               f"{name} is not available on torchbay here: {advice}")


def resolve(name: str, missing: Any) -> Any:
    """What torchbay answers for ``name`` from the library table, or ``missing``."""
    if name in table()["values"]:
        value = table()["values"][name]
        return list(value) if isinstance(value, list) else value
    if name in table()["functions"]:
        return globals()[name]
    kind = _plugin_kinds().get(name)
    if kind is not None:  # its plugin is not installed (an installed one serves or refuses it first)
        return placeholder(name, f"it comes from the {kind[1]} plugin: pip install {kind[1]}")
    distribution = _hinted().get(name)
    if distribution is not None:

        raise UnsupportedAPIError(f"{name} comes from the {distribution} plugin, which is not installed: "
                                  f"pip install {distribution} (see docs/accelerate-compat.md)")
    return missing


@functools.lru_cache(maxsize=1)
def _hinted() -> dict[str, str]:
    return {name: distribution for distribution, names in table()["plugin_hints"].items() for name in names}


class CustomDtype(enum.Enum):
    """Accelerate's data types that torch has no dtype for (quantized sizes in device-map arithmetic)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Free the cached memory of the process's accelerator (after a garbage collection, if asked)."""
    if garbage_collection:
        gc.collect()

    run = peek()
    strategy = run.strategy if run is not None else None
    if strategy is not None:
        strategy.device_backend.empty_cache()
    elif torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` says the device ran out of memory (a smaller batch may fit)."""
    return _is_out_of_memory(exception)


def get_module_class_from_name(module: torch.nn.Module, name: str) -> type | None:
    """The class called ``name`` among ``module`` and its submodules, or None."""
    for sub in module.modules():
        if type(sub).__name__ == name:
            return type(sub)
    return None


def get_parameters_from_modules(modules: Any, model: torch.nn.Module, device: Any) -> set:
    """The parameters of ``modules``: module objects, or a regex matched in full against ``model``'s qualified
    module names (those modules are moved to ``device``, as Accelerate does)."""
    import re

    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [m.to(device) for qualified, m in model.named_modules() if pattern.fullmatch(qualified)]
    return {p for m in modules for p in m.parameters()}
