"""Accelerate's whole public surface under the switch: every name of every Accelerate module imports.

``resources/accelerate_surface.yaml`` (written by ``scripts/scan_accelerate_surface.py`` from Accelerate 1.15) lists
each module's names with their kind. A stand-in module asks torchbay first; for a name torchbay does not serve it
answers from this table: a constant is served with Accelerate's value, an Accelerate submodule is that submodule's
stand-in, and anything else is a placeholder whose import works and whose use (building, calling, reading an
attribute) raises :class:`~torchbay.errors.UnsupportedAPIError` with the reason torchbay gives for it and what to
use instead. A name that is not in Accelerate's surface at all stays a missing attribute.
"""

from __future__ import annotations

import copy
import enum
import functools
import importlib
from typing import Any

from torchbay.errors import UnsupportedAPIError

SURFACE = "compat/resources/accelerate_surface.yaml"
MISSING = object()


@functools.lru_cache(maxsize=1)
def table() -> dict[str, dict[str, dict[str, Any]]]:
    """``{accelerate module: {name: {"kind": ..., "value"?: ...}}}``."""
    from torchbay.config.files import read_packaged_yaml

    return read_packaged_yaml("torchbay", SURFACE)["modules"]


def modules() -> list[str]:
    return list(table())


class _Placeholder:
    """An object standing for an Accelerate name torchbay does not serve: any use says why."""

    def __init__(self, name: str, reason: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_reason", reason)

    def _refuse(self, *args: Any, **kwargs: Any):
        raise UnsupportedAPIError(f"{self._name} is not available on torchbay: {self._reason}")

    __call__ = _refuse

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __repr__(self) -> str:
        return f"<torchbay placeholder for accelerate's {self._name}>"


@functools.lru_cache(maxsize=None)
def placeholder(module: str, name: str, kind: str, reason: str, said: str = "") -> Any:
    """A class (which cannot be built), a function (which cannot be called) or an object named ``name``; its use
    raises ``said`` (by default: ``<module>.<name> is not available on torchbay: <reason>``)."""
    said = said or f"{module}.{name} is not available on torchbay: {reason}"

    def refuse(*args: Any, **kwargs: Any):
        raise UnsupportedAPIError(said)

    if kind == "class":
        return type(name, (), {"__init__": refuse, "__doc__": f"Placeholder: {reason}", "__module__": module,
                               "_torchbay_placeholder": said})
    if kind == "function":
        refuse.__name__ = refuse.__qualname__ = name
        refuse.__module__ = module
        refuse.__doc__ = f"Placeholder: {reason}"
        refuse._torchbay_placeholder = said  # type: ignore[attr-defined]
        return refuse
    return _Placeholder(f"{module}.{name}", reason)


@functools.lru_cache(maxsize=None)
def _enum(module: str, name: str, str_based: bool, members: tuple) -> type[enum.Enum]:
    """Accelerate's enum with its members (one class per name): code reads members at import and compares them."""
    return enum.Enum(name, list(members), module=module, type=str if str_based else None)


def is_placeholder(value: Any) -> bool:
    return isinstance(value, _Placeholder) or hasattr(value, "_torchbay_placeholder")


def answer(module: str, name: str, reason: str) -> Any:
    """What the stand-in for ``module`` answers for ``name`` that torchbay does not serve, or :data:`MISSING`."""
    entry = table().get(module, {}).get(name)
    if entry is None:
        return MISSING
    kind = entry["kind"]
    if kind == "value":
        return copy.deepcopy(entry.get("value"))
    if kind == "enum":
        return _enum(module, name, entry["value"]["str"], tuple(entry["value"]["members"].items()))
    if kind == "module":
        return importlib.import_module(entry.get("value") or f"{module}.{name}")
    return placeholder(module, name, kind, reason)
