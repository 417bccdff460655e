"""Accelerate's tracker registry: ``LOGGER_TYPE_TO_CLASS``, ``register_tracker_class`` and the tracker classes
by Accelerate's names (``accelerate.tracking.MLflowTracker`` ...).

Installed tracker plugins register their classes through the hook ``torchbay_register_trackers``; a user's own
``GeneralTracker`` subclass joins them with :func:`register_tracker_class`, as in Accelerate, and is then selected
by its name in ``log_with``. :data:`LOGGER_TYPE_TO_CLASS` is the mapping of both (the plugins' classes are imported
when read, never their libraries).

A class that follows Accelerate's constructor convention (no ``settings`` parameter: ``cls(project_name,
logging_dir, **init_kwargs)`` when ``requires_logging_directory``, else ``cls(project_name, **init_kwargs)``) gets
Accelerate's logging directory: ``tracking.logging_dir``, ``project.logging_dir`` or ``project.project_dir``,
whichever was set; when none was, such a class that requires a directory is refused before training starts.
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from typing import Any, Iterator, Mapping

from torchbay._lazy import attach
from torchbay.registry.lazy_class import loaded
from torchbay.tracking import trackers
from torchbay.tracking.trackers import (  # noqa: F401 (Accelerate-convention helpers, read from here)
    LOGGING_DIR_SETTINGS,
    GeneralTracker,
    TrackerError,
    accelerate_logging_dir,
    convention_problems,
    follows_accelerate_layout,
    takes_settings,
)


class TrackerClasses(MutableMapping):
    """``{name: tracker class}``: the installed plugins' classes, with the user's registrations over them.

    Removing a plugin's name hides it from this process's selection (as deleting it from Accelerate's dict does)."""

    def __init__(self) -> None:
        self.added: dict[str, type[GeneralTracker]] = {}
        self.removed: set[str] = set()

    @staticmethod
    def _plugins() -> Mapping[str, Any]:
        from torchbay.registry.manager import get_plugin_manager

        return get_plugin_manager().registries()["trackers"]

    def merged(self, plugins: Mapping[str, Any]) -> dict[str, Any]:
        """``plugins`` (a plugin manager's tracker registry) with this process's registrations applied."""
        return {**{n: c for n, c in plugins.items() if n not in self.removed}, **self.added}

    def __getitem__(self, name: str) -> type[GeneralTracker]:
        return loaded(self.merged(self._plugins())[name])

    def __setitem__(self, name: str, cls: type[GeneralTracker]) -> None:
        self.added[name] = cls
        self.removed.discard(name)

    def __delitem__(self, name: str) -> None:
        if name not in self.merged(self._plugins()):
            raise KeyError(name)
        self.added.pop(name, None)
        self.removed.add(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.merged(self._plugins()))

    def __len__(self) -> int:
        return len(self.merged(self._plugins()))

    def __repr__(self) -> str:
        return f"LOGGER_TYPE_TO_CLASS({sorted(self)})"


#: Accelerate's ``LOGGER_TYPE_TO_CLASS``: every tracker ``log_with`` can name in this process
LOGGER_TYPE_TO_CLASS = TrackerClasses()
trackers.process_registrations = LOGGER_TYPE_TO_CLASS  # selection sees them (none exist before this import)


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``tracker_class`` selectable by its ``name`` in ``log_with`` (Accelerate's function). Register it
    before building the Accelerator that uses it; a name already taken is replaced, with a warning."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise TrackerError(f"register_tracker_class({tracker_class!r}): give a subclass of "
                           f"torchbay.tracking.GeneralTracker")
    if not getattr(tracker_class, "name", None):
        raise TrackerError(f"register_tracker_class({tracker_class.__name__}): set its class attribute 'name' (the "
                           f"name log_with selects it by)")
    if "requires_logging_directory" not in _own_attributes(tracker_class):
        raise TrackerError(f"register_tracker_class({tracker_class.__name__}): set its class attribute "
                           f"'requires_logging_directory' (True: it is built with the logging directory)")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"A tracker named '{tracker_class.name}' is already registered; {tracker_class.__name__} "
                      f"replaces it in this process", UserWarning, stacklevel=2)
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def _own_attributes(cls: type) -> set[str]:
    """Attributes set by ``cls`` or a class between it and GeneralTracker (GeneralTracker's defaults excluded)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is GeneralTracker:
            break
        names |= set(vars(klass))
    return names


def accelerate_class(attr: str) -> type[GeneralTracker]:
    """The installed tracker class named ``attr`` (``accelerate.tracking.<Name>Tracker``): each plugin's class
    carries Accelerate's class name for its tracker, so the core needs no list of tracking libraries."""
    if attr.endswith("Tracker"):
        for name, cls in LOGGER_TYPE_TO_CLASS.merged(LOGGER_TYPE_TO_CLASS._plugins()).items():
            if _class_name(cls) == attr:
                return LOGGER_TYPE_TO_CLASS[name]
    raise AttributeError(f"module 'torchbay.tracking.registry' has no attribute {attr!r}")


def _class_name(cls: Any) -> str:
    """A class's name, read from a lazily registered class's target (``module:Class``) without importing it."""
    target = getattr(cls, "target", None)
    return target.rpartition(":")[2] if isinstance(target, str) else getattr(cls, "__name__", "")


__getattr__, __dir__ = attach(__name__, {}, otherwise=accelerate_class)  # the tracker classes, by Accelerate's names
