"""Finding, loading and controlling torchbay plugins.

Plugins are entry points in group ``torchbay``. Control, as pytest has:

- ``TORCHBAY_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry-point plugin, except those named in
  ``TORCHBAY_PLUGINS``;
- ``TORCHBAY_PLUGINS=a,b``: with autoload disabled, load these;
- ``block=["name"]`` (``-p no:name`` on the command line, ``TORCHBAY_BLOCK_PLUGINS``): never load it;
- ``required_plugins`` (config key ``plugins.required``): fail when one is not loaded.

A plugin that fails to import or register is recorded with its distribution, version and
the exception; the core keeps working without it.
"""

from __future__ import annotations

import importlib
import importlib.metadata as importlib_metadata
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable

import pluggy

from torchbay import hookspecs
from torchbay.errors import PluginError

ENTRY_POINT_GROUP = "torchbay"
hookimpl = pluggy.HookimplMarker("torchbay")

BUILTIN_PLUGINS = (
    "torchbay.builtin.cpu",
    "torchbay.builtin.strategies",
    "torchbay.builtin.amp",
    "torchbay.builtin.checkpoint_io",
    "torchbay.builtin.cluster",
    "torchbay.builtin.validation",
)


@dataclass
class PluginInfo:
    """What ``torchbay plugins`` shows about one plugin."""

    name: str
    distribution: str
    version: str
    status: str  # "loaded", "builtin", "failed", "blocked", "not autoloaded"
    error: str = ""
    hooks: list[str] = field(default_factory=list)
    registers: list[str] = field(default_factory=list)


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


class PluginManager(pluggy.PluginManager):
    """A pluggy manager with torchbay's hookspecs, built-ins and entry-point loading.

    Build one with :func:`get_plugin_manager` (cached per process) or directly in tests.
    """

    def __init__(self, *, block: Iterable[str] = (), autoload: bool | None = None,
                 only: Iterable[str] | None = None, builtins: bool = True):
        super().__init__("torchbay")
        self.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.blocked = set(block) | set(_env_list("TORCHBAY_BLOCK_PLUGINS"))
        if autoload is None:
            autoload = os.environ.get("TORCHBAY_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0", "false")
        self.autoload = autoload
        self.only = set(only) if only is not None else set(_env_list("TORCHBAY_PLUGINS"))
        # historic: every plugin registered from now on receives it at registration
        self.hook.torchbay_addhooks.call_historic(kwargs={"pluginmanager": self})
        if builtins:
            self._register_builtins()
        self._load_entry_points()
        self._load_named_modules()
        self._registries: dict[str, dict[str, Any]] | None = None

    # -- loading ------------------------------------------------------------------------
    def _register_builtins(self) -> None:
        version = _own_version()
        for modname in BUILTIN_PLUGINS:
            short = modname.rsplit(".", 1)[1]
            if short in self.blocked:
                self.infos[short] = PluginInfo(short, "torchbay", version, "blocked")
                continue
            module = __import__(modname, fromlist=["_"])
            self.register(module, name=short)
            self.infos[short] = PluginInfo(short, "torchbay", version, "builtin")

    def _load_entry_points(self) -> None:
        for ep in _entry_points():
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else "?"
            dist_version = dist.version if dist is not None else "?"
            info = PluginInfo(ep.name, dist_name, dist_version, "loaded")
            self.infos[ep.name] = info
            if ep.name in self.blocked:
                info.status = "blocked"
                continue
            if not self.autoload and ep.name not in self.only:
                info.status = "not autoloaded"
                continue
            try:
                plugin = ep.load()
                self.register(plugin, name=ep.name)
            except Exception as exc:  # a broken plugin must not break the core
                info.status = "failed"
                info.error = f"{type(exc).__name__}: {exc}"
                info.traceback = traceback.format_exc()  # type: ignore[attr-defined]

    def _load_named_modules(self) -> None:
        """``TORCHBAY_PLUGINS`` / ``-p`` names that are no entry point are imported as modules."""
        for name in sorted(self.only - set(self.infos) - self.blocked):
            info = self.infos[name] = PluginInfo(name, "(module)", "", "loaded")
            try:
                self.register(importlib.import_module(name), name=name)
            except Exception as exc:
                info.status, info.error = "failed", f"{type(exc).__name__}: {exc}"

    def register_plugin(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, notebooks); resets the registries."""
        self.register(plugin, name=name)
        self.infos[name] = PluginInfo(name, "(in process)", "", "loaded")
        self._registries = None

    # -- queries ------------------------------------------------------------------------
    def failed_plugins(self) -> list[PluginInfo]:
        return [info for info in self.infos.values() if info.status == "failed"]

    def check_required(self, required: Iterable[str]) -> None:
        missing = []
        for name in required:
            info = self.infos.get(name) or next(
                (i for i in self.infos.values() if i.distribution == name), None)
            if info is None:
                missing.append(f"required plugin '{name}' is not installed: pip install {name}")
            elif info.status not in ("loaded", "builtin"):
                detail = f" ({info.error})" if info.error else ""
                missing.append(f"required plugin '{name}' is {info.status}{detail}")
        if missing:
            raise PluginError("\n".join(missing))

    def registries(self) -> dict[str, dict[str, Any]]:
        """``{"devices": {name: cls}, "strategies": ..., "precisions": ..., ...}``, built once."""
        if self._registries is None:
            self._registries = {
                "devices": self._collect(self.hook.torchbay_register_devices, "device"),
                "strategies": self._collect(self.hook.torchbay_register_strategies, "strategy"),
                "precisions": self._collect(self.hook.torchbay_register_precisions, "precision",
                                            key=_precision_key),
                "checkpoint_io": self._collect(self.hook.torchbay_register_checkpoint_io, "checkpoint io"),
                "cluster_environments": self._collect(
                    self.hook.torchbay_register_cluster_environments, "cluster environment"),
            }
            self._record_registrations()
        return self._registries

    def _collect(self, hook, what: str, key=lambda cls: cls.name) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for impl in reversed(hook.get_hookimpls()):  # registration order, built-ins first
            try:
                classes = impl.function() or []
            except Exception as exc:
                self._mark_failed(impl.plugin_name, f"{hook.name} raised {type(exc).__name__}: {exc}")
                continue
            for cls in classes:
                name = key(cls)
                if name in found and found[name] is not cls:
                    raise PluginError(
                        f"{what} '{name}' is registered twice: by {found[name].__module__} and by "
                        f"{cls.__module__} (plugin '{impl.plugin_name}'); uninstall one or block it "
                        f"with TORCHBAY_BLOCK_PLUGINS={impl.plugin_name}")
                cls._torchbay_plugin = impl.plugin_name
                found[name] = cls
        return found

    def _mark_failed(self, plugin_name: str, error: str) -> None:
        info = self.infos.setdefault(plugin_name, PluginInfo(plugin_name, "?", "?", "failed"))
        info.status, info.error = "failed", error
        self.unregister(name=plugin_name)

    def _record_registrations(self) -> None:
        singular = {"devices": "device", "strategies": "strategy", "precisions": "precision",
                    "checkpoint_io": "checkpoint_io", "cluster_environments": "cluster_environment"}
        for kind, registry in self._registries.items():
            for name, cls in registry.items():
                info = self.infos.get(getattr(cls, "_torchbay_plugin", ""))
                if info is not None:
                    info.registers.append(f"{singular[kind]}:{name}")

    def hooks_of(self, name: str) -> list[str]:
        plugin = self.get_plugin(name)
        if plugin is None:
            return []
        return sorted(caller.name for caller in self.get_hookcallers(plugin) or [])

    def config_sections(self) -> dict[str, Any]:
        sections: dict[str, Any] = {}
        owners: dict[str, str] = {}
        for impl in reversed(self.hook.torchbay_config_sections.get_hookimpls()):
            for name, model in (impl.function() or {}).items():
                if name in sections:
                    raise PluginError(f"config section '{name}' is claimed by plugins "
                                      f"'{owners[name]}' and '{impl.plugin_name}'; block one of them")
                sections[name], owners[name] = model, impl.plugin_name
        return sections


def _precision_key(cls) -> str:
    backend = getattr(cls, "fp8_backend", None)
    return f"{cls.name}:{backend}" if backend else cls.name


def _entry_points():
    return importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)


def _own_version() -> str:
    try:
        return importlib_metadata.version("torchbay")
    except importlib_metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


_cached: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use (never at import time)."""
    global _cached
    if _cached is None:
        _cached = PluginManager()
    return _cached


def reset_plugin_manager(pm: PluginManager | None = None) -> None:
    """Replace (or drop, with ``None``) the process-wide manager; for tests and notebooks."""
    global _cached
    _cached = pm
