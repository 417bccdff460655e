"""Finding, loading and controlling torchbay plugins.

Plugins are entry points in group ``torchbay``. Control, as pytest has:

- ``TORCHBAY_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry-point plugin, except those named in
  ``TORCHBAY_PLUGINS``;
- ``TORCHBAY_PLUGINS=a,b``: with autoload disabled, load these;
- ``block=["name"]`` (``-p no:name`` on the command line, ``TORCHBAY_BLOCK_PLUGINS``): never load it;
- ``required_plugins`` (config key ``plugins.required``): fail when one is not loaded.

A third-party plugin that fails (at import, or by raising anything but ``KeyboardInterrupt``
in any hook, ``SystemExit`` included, or by registering a name that is already taken) is
*disabled for the run*: one warning names the plugin, its distribution, the hook and the
error; ``torchbay plugins`` lists it as failed; its hooks do nothing from then on and what
it registered is dropped. When a device, strategy, precision or checkpoint io of the run
comes from it, the run stops with that same message (:class:`~torchbay.errors.PluginError`).
A :class:`~torchbay.errors.TorchbayError` raised on purpose by a hook is the plugin's answer,
not a failure, and propagates.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as importlib_metadata
import logging
import os
import traceback
from typing import Any, Iterable

import pluggy

from torchbay import hookspecs
from torchbay.axes.precision import registry_key
from torchbay.errors import PluginError, TorchbayError
from torchbay.registry import api_version
from torchbay.registry.contributions import Contributions
from torchbay.registry.info import PluginInfo, _describe, _env_list, _own_version
from torchbay.registry.lazy_class import loaded

ENTRY_POINT_GROUP = "torchbay"
hookimpl = pluggy.HookimplMarker("torchbay")
log = logging.getLogger("torchbay")

BUILTIN_PLUGINS = (
    "torchbay.builtin.cpu",
    "torchbay.builtin.strategies",
    "torchbay.builtin.amp",
    "torchbay.builtin.checkpoint_io",
    "torchbay.builtin.cluster",
    "torchbay.builtin.environment",
    "torchbay.builtin.tracking",
)
#: exceptions that are never a plugin's failure: the user pressing Ctrl-C, generator clean-up
_NOT_A_FAILURE = (KeyboardInterrupt, GeneratorExit)


class PluginManager(Contributions, pluggy.PluginManager):
    """A pluggy manager with torchbay's hookspecs, built-ins and entry-point loading.

    Build one with :func:`get_plugin_manager` (cached per process) or directly in tests.
    Every hook implementation of a non-built-in plugin is guarded: see the module docstring.
    """

    def __init__(self, *, block: Iterable[str] = (), autoload: bool | None = None,
                 only: Iterable[str] | None = None, builtins: bool = True):
        super().__init__("torchbay")
        self.infos: dict[str, PluginInfo] = {}
        #: plugins that provide the selected device/strategy/precision/checkpoint io of this run
        self.selected: set[str] = set()
        self._guarding = False
        self._registries: dict[str, dict[str, Any]] | None = None
        self.add_hookspecs(hookspecs)
        self.blocked = set(block) | set(_env_list("TORCHBAY_BLOCK_PLUGINS"))
        if autoload is None:
            autoload = os.environ.get("TORCHBAY_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0", "false")
        self.autoload = autoload
        self.only = set(only) if only is not None else set(_env_list("TORCHBAY_PLUGINS"))
        if builtins:
            self._register_builtins()
        self._guarding = True  # everything registered from here on is third-party
        self._load_entry_points()
        self._load_named_modules()

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
            self.infos[short] = PluginInfo(short, "torchbay", version, "builtin",
                                           api=api_version.show(api_version.API_VERSION))

    def _load_entry_points(self) -> None:
        for ep in _entry_points():
            metadata = ep.dist.metadata if getattr(ep, "dist", None) is not None else None  # parsed once
            dist_name = metadata["Name"] if metadata is not None else "?"
            dist_version = metadata["Version"] if metadata is not None else "?"
            if ep.name in self.infos:  # a built-in's name, or another distribution's entry point
                owner = self.infos[ep.name].distribution
                taken = "a built-in plugin" if owner == "torchbay" else f"a plugin of distribution {owner}"
                info = PluginInfo(ep.name, dist_name, dist_version, "failed")
                self._fail(info, "entry point", f"its entry-point name '{ep.name}' is the name of {taken} "
                           f"(blocking that name would block both)", key=f"{ep.name} ({dist_name})",
                           remedy=f"pip uninstall {dist_name}, or rename its entry point")
                continue
            info = PluginInfo(ep.name, dist_name, dist_version, "loaded")
            self.infos[ep.name] = info
            if ep.name in self.blocked:
                info.status = "blocked"
                continue
            if not self.autoload and ep.name not in self.only:
                info.status = "not autoloaded"
                continue
            self._load(info, ep.load)

    def _load_named_modules(self) -> None:
        """``TORCHBAY_PLUGINS`` / ``-p`` names that are no entry point are imported as modules."""
        for name in sorted(self.only - set(self.infos) - self.blocked):
            info = self.infos[name] = PluginInfo(name, "(module)", "", "loaded")
            self._load(info, lambda name=name: importlib.import_module(name))

    def _load(self, info: PluginInfo, load) -> None:
        try:
            plugin = load()
        except _NOT_A_FAILURE:
            raise
        except BaseException as exc:  # SystemExit included: a broken plugin must not break the core
            info.traceback = traceback.format_exc()  # type: ignore[attr-defined]
            self._fail(info, "import", _describe(exc))
            return
        if not self._accepts_api_version(info, plugin):
            return
        try:
            self.register(plugin, name=info.name)
        except _NOT_A_FAILURE:
            raise
        except BaseException as exc:
            self._fail(info, "registration", _describe(exc))
            if self.get_plugin(info.name) is plugin:
                self.unregister(name=info.name)  # partly registered: take every hook back out

    def _accepts_api_version(self, info: PluginInfo, plugin: Any) -> bool:
        try:
            version = api_version.declared_version(plugin)
        except ValueError as exc:
            self._fail(info, "registration", str(exc))
            return False
        info.api = api_version.show(version)
        decision, message = api_version.verdict(info.name, info.distribution, version)
        if decision != "ok":
            info.message = message
            log.warning("torchbay: %s", message)
        if decision == "refuse":
            info.status, info.error = "refused", message
            return False
        return True

    def register_plugin(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, notebooks); resets the registries."""
        self.infos[name] = PluginInfo(name, "(in process)", "", "loaded")
        self.register(plugin, name=name)
        self._registries = None

    # -- isolation ------------------------------------------------------------------------
    def _verify_hook(self, hook, hookimpl) -> None:
        super()._verify_hook(hook, hookimpl)
        # wrap before pluggy replays historic calls to the new implementation
        if self._guarding and not hookimpl.hookwrapper and not getattr(hookimpl.function, "_torchbay_guard", False):
            hookimpl.function = self._guard(hookimpl.plugin_name, hook.name, hookimpl.function, hookimpl.wrapper)

    def _guard(self, plugin: str, hook: str, function, wrapper: bool):
        pm = self
        if not wrapper:
            @functools.wraps(function)
            def guarded(*args, **kwargs):
                if pm.is_failed(plugin):
                    return None
                try:
                    return function(*args, **kwargs)
                except (TorchbayError, *_NOT_A_FAILURE):
                    raise
                except BaseException as exc:
                    pm.hook_failed(plugin, hook, exc)
                    return None
        else:
            @functools.wraps(function)
            def guarded(*args, **kwargs):
                if pm.is_failed(plugin):
                    return (yield)
                try:
                    gen = function(*args, **kwargs)
                    next(gen)
                except (TorchbayError, *_NOT_A_FAILURE):
                    raise
                except BaseException as exc:
                    pm.hook_failed(plugin, hook, exc)
                    return (yield)
                try:
                    result = yield
                except BaseException as exc:  # a later implementation raised: the wrapper may handle it
                    try:
                        gen.throw(exc)
                    except StopIteration as stop:
                        return stop.value
                    raise exc from None
                try:
                    gen.send(result)
                except StopIteration as stop:
                    return stop.value
                except (TorchbayError, *_NOT_A_FAILURE):
                    raise
                except BaseException as exc:
                    pm.hook_failed(plugin, hook, exc)
                    return result
                pm.hook_failed(plugin, hook, RuntimeError("the wrapper yielded twice"))
                return result
        guarded._torchbay_guard = True
        return guarded

    def info_of(self, name: str) -> PluginInfo:
        """What is known about plugin ``name`` (a placeholder for one registered without an info)."""
        return self.infos.setdefault(name, PluginInfo(name, "?", "?", "failed"))

    def is_failed(self, name: str) -> bool:
        info = self.infos.get(name)
        return info is not None and info.status == "failed"

    def hook_failed(self, name: str, hook: str, exc: BaseException) -> None:
        """Disable plugin ``name`` after ``hook`` raised ``exc``; raise when the run depends on it."""
        info = self.infos.setdefault(name, PluginInfo(name, "?", "?", "failed"))
        info.traceback = "".join(traceback.format_exception(exc))  # type: ignore[attr-defined]
        self._fail(info, hook, _describe(exc))
        if name in self.selected:
            version = f" {info.version}" if info.version and info.version != "?" else ""
            raise PluginError(f"plugin '{name}' (distribution {info.distribution}{version}) failed in {hook}: "
                              f"{_describe(exc)}; this run uses it (its device, strategy, precision or checkpoint "
                              f"io), so the run stops (the plugin's traceback is chained to this error)") from exc

    def _fail(self, info: PluginInfo, hook: str, error: str, key: str | None = None, remedy: str = "") -> None:
        if info.status == "failed" and info.message:
            return  # one warning per plugin
        version = f" {info.version}" if info.version and info.version != "?" else ""
        where = "while loading" if hook in ("import", "registration", "entry point") else f"in {hook}"
        info.status, info.error, info.hook = "failed", error, hook
        info.message = (f"plugin '{info.name}' (distribution {info.distribution}{version}) failed {where}: "
                        f"{error}; it is disabled for this run ({remedy or info.how_to_remove()})")
        self.infos[key or info.name] = info
        self._registries = None
        log.warning("torchbay: %s", info.message)

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
        """``{"devices": {name: cls}, "strategies": ..., "precisions": ..., "trackers": ...}``, built once.

        Implementations are collected built-ins first, then in registration order; a later
        plugin that registers a name already taken is the one that fails.
        """
        while self._registries is None:
            failed_before = len(self.failed_plugins())
            registries = {
                "devices": self._collect(self.hook.torchbay_register_devices, "device"),
                "strategies": self._collect(self.hook.torchbay_register_strategies, "strategy"),
                "precisions": self._collect(self.hook.torchbay_register_precisions, "precision",
                                            key=_precision_key),
                "checkpoint_io": self._collect(self.hook.torchbay_register_checkpoint_io, "checkpoint io"),
                "cluster_environments": self._collect(
                    self.hook.torchbay_register_cluster_environments, "cluster environment"),
                "trackers": self._collect(self.hook.torchbay_register_trackers, "tracker"),
            }
            if len(self.failed_plugins()) == failed_before:  # a failure drops all of a plugin's classes
                self._registries = registries
                self._record_registrations()
        return self._registries

    def _collect(self, hook, what: str, key=lambda cls: cls.name) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for impl in hook.get_hookimpls():  # registration order: built-ins first
            if self.is_failed(impl.plugin_name):
                continue
            classes = impl.function() or []
            if self.is_failed(impl.plugin_name):  # it raised
                continue
            try:
                named = [(str(key(cls)), cls) for cls in classes]
            except Exception as exc:
                self._fail(self.infos.setdefault(impl.plugin_name, PluginInfo(impl.plugin_name, "?", "?", "failed")),
                           hook.name, f"returned {classes!r}, not a list of {what} classes ({_describe(exc)})")
                continue
            for name, cls in named:
                if name in found and found[name] is not cls:
                    self._clash(what, name, getattr(found[name], "_torchbay_plugin", "?"), impl.plugin_name,
                                hook.name)
                    break
                if name not in found:
                    cls._torchbay_plugin = impl.plugin_name
                    found[name] = cls
        return {name: cls for name, cls in found.items()
                if not self.is_failed(getattr(cls, "_torchbay_plugin", ""))}

    def load_registered(self, entry: Any) -> Any:
        """The class a registry entry stands for, imported now if its plugin registered it lazily
        (:class:`~torchbay.plugin.LazyClass`); None when that fails, which disables the plugin
        as a failing hook does (a run that selected the class reports the plugin's message)."""
        try:
            return loaded(entry)
        except PluginError as exc:  # only a LazyClass raises it
            self._fail(self.info_of(getattr(entry, "_torchbay_plugin", "?")), "import", exc.reason)
            return None

    def load_every_registered(self) -> None:
        """Import every lazily registered class now (``torchbay plugins`` does, to list a plugin whose class
        cannot be imported as failed before a run selects it)."""
        for registry in self.registries().values():
            for entry in list(registry.values()):
                self.load_registered(entry)

    def _clash(self, what: str, name: str, first: str, second: str, hook: str) -> None:
        owner = self.infos.get(first)
        by = (f"the built-in plugin '{first}'" if owner is not None and owner.distribution == "torchbay"
              else f"plugin '{first}'" + (f" ({owner.distribution})" if owner else ""))
        info = self.infos.setdefault(second, PluginInfo(second, "?", "?", "failed"))
        self._fail(info, hook, f"it registers {what} '{name}', which {by} already provides")

    def _record_registrations(self) -> None:
        singular = {"devices": "device", "strategies": "strategy", "precisions": "precision",
                    "checkpoint_io": "checkpoint_io", "cluster_environments": "cluster_environment",
                    "trackers": "tracker"}
        for info in self.infos.values():
            info.registers = []
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


def _precision_key(cls) -> str:
    return registry_key(cls)


def _entry_points():
    return importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)


_cached: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use (never at import time)."""
    global _cached
    if _cached is None:
        _cached = PluginManager()
    return _cached


def peek_plugin_manager() -> PluginManager | None:
    """The process-wide manager if one was built (nothing is built here)."""
    return _cached


def reset_plugin_manager(pm: PluginManager | None = None) -> None:
    """Replace (or drop, with ``None``) the process-wide manager; for tests and notebooks."""
    global _cached
    _cached = pm
