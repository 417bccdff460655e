"""A class a plugin registers by its import path, imported only when a run uses it (plugin API 1.1).

A registration hook (``torchbay_register_strategies``, ``..._precisions``, ``..._trackers``...) may return,
instead of a class, ``LazyClass("package.module:ClassName", name="...")``: the name (and, for a precision
engine, the ``engine``) the class registers under, so that the registry knows it without importing it. A run
that does not select the class never imports its module::

    @hookimpl
    def torchbay_register_strategies():
        return [LazyClass("mypackage.strategy:MyStrategy", name="mystrategy")]

The class is imported when the run selects it, or when anything reads one of its attributes other than
``name``/``engine`` (``priority``, ``is_available``, ``check``...). A module that cannot be imported, or a
class whose own ``name``/``engine`` differ from the registered ones, is a :class:`~torchbay.errors.PluginError`
that names the plugin, the class path and the fix.
"""

from __future__ import annotations

import importlib
from typing import Any

from torchbay.errors import PluginError


class LazyClass:
    """Stands in a registry for the class at ``target`` (``"module:ClassName"``) until it is used."""

    def __init__(self, target: str, *, name: str, engine: str | None = None):
        module, _, attribute = target.partition(":")
        if not module or not attribute.isidentifier():
            raise ValueError(f"LazyClass({target!r}): write the class path as 'package.module:ClassName'")
        self.target = target
        self.name = name
        self.engine = engine
        self._class: type | None = None

    def load(self) -> type:
        """The class itself (imported on the first call), checked against the registered name and engine."""
        if self._class is None:
            module, _, attribute = self.target.partition(":")
            try:
                cls = getattr(importlib.import_module(module), attribute)
            except Exception as exc:
                raise self._error(f"its class {self.target} (registered as '{self.name}') cannot be imported "
                                  f"({type(exc).__name__}: {exc})", f"reinstall its distribution, or block it "
                                  f"with -p no:{self._owner}") from exc
            declared = (getattr(cls, "name", None), getattr(cls, "engine", None))
            if declared != (self.name, self.engine):
                raise self._error(f"it registered {self.target} as name={self.name!r}, engine={self.engine!r}, "
                                  f"but the class declares name={declared[0]!r}, engine={declared[1]!r}",
                                  "the plugin must register the class under the class's own name and engine")
            cls._torchbay_plugin = self._owner
            self._class = cls
        return self._class

    @property
    def _owner(self) -> str:
        """The plugin that registered it (the plugin manager sets it when it collects the registrations)."""
        return self.__dict__.get("_torchbay_plugin", "?")

    def _error(self, reason: str, fix: str) -> PluginError:
        error = PluginError(f"plugin '{self._owner}': {reason}; {fix}")
        error.reason = reason  # what the plugin manager's own message says
        return error

    def __getattr__(self, attribute: str) -> Any:
        # called only for what the stand-in does not hold itself: the class answers, imported now
        if attribute.startswith("__") or attribute in ("_class", "_torchbay_plugin"):
            raise AttributeError(attribute)
        return getattr(self.load(), attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __repr__(self) -> str:
        state = "imported" if self._class is not None else "not imported"
        return f"LazyClass({self.target!r}, name={self.name!r}{f', engine={self.engine!r}' if self.engine else ''}; " \
               f"{state})"


def loaded(entry: Any) -> Any:
    """The class a registry entry stands for (a class is itself)."""
    return entry.load() if isinstance(entry, LazyClass) else entry
