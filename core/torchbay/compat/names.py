"""Accelerate names that torchbay answers by asking its plugins, or refuses with advice.

``resolve(name)`` gives, for a name not defined in :mod:`torchbay.utils` or :mod:`torchbay`:

- ``is_<x>_available``: a function answered by the installed plugins (a device named x, a
  strategy or FP8 engine with its library) or by whether library x is installed;
- ``check_<device>_fp8_capability``: whether that device plugin reports compute capability 8.9+;
- a backend's name (``FullyShardedDataParallelPlugin``...): taken from its plugin when installed;
- a name torchbay does not offer: an :class:`UnsupportedAPIError` saying what to use instead.

The tables are data, so the core names no backend: the core's (``resources/accelerate_api.yaml``)
holds the generic names, and each plugin adds the names it serves (its device's
``is_<name>_available``, its backend's names and refusals) through the hook
``torchbay_accelerate_mapping``. A backend's name whose plugin is not installed is therefore
not offered: asking for it is an AttributeError, as for any name torchbay does not know.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from typing import Any, Callable

import torch

from torchbay.compat import library_names
from torchbay.errors import UnsupportedAPIError  # noqa: F401 (its old path, still served)
from torchbay.process.current import peek
from torchbay.process.state import accelerate_api_table
from torchbay.registry.manager import get_plugin_manager

MISSING = object()


_merged: tuple[Any, Any, dict[str, Any]] = (None, None, {})  # (plugin manager, its plugins, merged table)


def _plugins_of(pm) -> tuple:
    return (tuple(sorted((name, id(plugin)) for name, plugin in pm.list_name_plugin())),
            tuple(sorted(info.name for info in pm.failed_plugins())))


def _table() -> dict[str, Any]:
    """The core's API table with every installed plugin's ``api`` fragment merged in.

    Merged on first use and again whenever the process's plugin manager, its plugins or the
    failed ones change.
    """
    global _merged
    pm = get_plugin_manager()
    if _merged[0] is not pm or _merged[1] != _plugins_of(pm):
        table = pm.accelerate_mapping("api", accelerate_api_table())
        _merged = (pm, _plugins_of(pm), table)  # (after merging: a conflict may have failed a plugin)
    return _merged[2]


def api_table() -> dict[str, Any]:
    """The merged API table (the core's ``accelerate_api.yaml`` and every installed plugin's ``api`` part)."""
    return _table()


def _registries() -> dict[str, dict[str, Any]]:
    return get_plugin_manager().registries()


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _device_available(device: str) -> bool:
    cls = _registries()["devices"].get(device)
    try:
        return bool(cls is not None and cls.is_available())
    except Exception:
        return False


def _current_device_cls():
    run = peek()
    if run is not None:
        return type(run.strategy.device_backend)
    available = [c for c in _registries()["devices"].values() if c.is_available()]
    return max(available, key=lambda c: c.priority) if available else None


def is_habana_gaudi1() -> bool:
    """Whether the device is a first-generation Gaudi; a device plugin that can tell says so."""
    cls = _current_device_cls()
    return bool(getattr(cls, "is_first_generation", False))


def _autocast_available(dtype: torch.dtype) -> bool:
    cls = _current_device_cls()
    return bool(cls is not None and cls.supports_autocast(dtype))


def _fp8_available() -> bool:
    for cls in _registries()["precisions"].values():
        if getattr(cls, "name", "") == "fp8" and cls.unavailable_reason(_current_device_cls()) is None:
            return True
    return False




def availability(what: str) -> Callable[..., bool]:
    """The ``is_<what>_available`` function (any arguments Accelerate's takes are accepted)."""
    table = _table()
    if what in ("fp16", "bf16"):
        dtype = torch.float16 if what == "fp16" else torch.bfloat16
        answer: Callable[[], bool] = functools.partial(_autocast_available, dtype)
    elif what == "fp8":
        answer = _fp8_available
    elif what == "rocm":
        answer = lambda: getattr(torch.version, "hip", None) is not None  # noqa: E731
    elif what in table["available_devices"]:
        answer = functools.partial(_device_available, table["available_devices"][what])
    elif what in table["available_plugins"]:  # its plugin is installed (it added the entry): is its library?
        answer = functools.partial(_has_module, table["available_plugins"][what])
    else:
        answer = functools.partial(_has_module, table["available_modules"].get(what, what))

    def is_available(*args: Any, **kwargs: Any) -> bool:
        return answer()

    is_available.__name__ = f"is_{what}_available"
    is_available.__doc__ = f"Whether {what} can be used here (answered by torchbay's installed plugins)."
    return is_available


def fp8_capability(device: str) -> Callable[[], bool]:
    def check(*args: Any, **kwargs: Any) -> bool:
        cls = _registries()["devices"].get(device)
        if cls is None or not _device_available(device):
            return False
        capability = cls.compute_capability(0)
        return capability is not None and tuple(capability) >= (8, 9)

    check.__name__ = f"check_{device}_fp8_capability"
    return check


def refusal(name: str, advice: str) -> Any:
    raise UnsupportedAPIError(f"{name} is not offered by torchbay: {advice} (see docs/accelerate-compat.md)")


def resolve(name: str) -> Any:
    """What torchbay answers for the Accelerate name ``name``, or :data:`MISSING`."""
    if name.startswith("_"):
        return MISSING
    match = re.fullmatch(r"is_(\w+)_available", name)
    if match:
        return availability(match.group(1))
    match = re.fullmatch(r"check_(\w+)_fp8_capability", name)
    if match:
        return fp8_capability(match.group(1))
    plugin = _table().get("plugin_names", {}).get(name)
    if plugin is not None:
        if not _has_module(plugin["module"].split(".")[0]):
            refusal(name, f"it comes from the {plugin['install']} plugin: pip install {plugin['install']}")
        try:
            module = importlib.import_module(plugin["module"])
        except ImportError:
            module = None
        if not hasattr(module, name):
            refusal(name, f"the installed {plugin['install']} does not provide it yet")
        return getattr(module, name)
    entry = unsupported().get(name)
    if entry is not None:
        if name in library_names.placeholders():  # a library imports it: importing must work, using it says why
            return library_names.placeholder(name, f"{entry['advice']} (see docs/accelerate-compat.md)")
        refusal(name, entry["advice"])
    return library_names.resolve(name, MISSING)


def unsupported() -> dict[str, dict[str, str]]:
    """``{name: {"status": "refused" | "not-planned", "advice": ...}}`` from the table."""
    out = {}
    for group in _table().get("unsupported", []):
        for name in group["names"]:
            out[name] = {"status": group["status"], "advice": " ".join(group["advice"].split())}
    return out
