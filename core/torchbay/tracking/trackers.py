"""Experiment trackers: choosing trackers by name, Accelerate's tracker names (``LoggerType``,
``on_main_process``), and converting logged values. The interface itself, ``GeneralTracker``, is
:mod:`torchbay.axes.tracker`.

The core knows only this interface and one dependency-free tracker (``jsonl``). Every other
tracker (one per tracking library) is a plugin distribution that returns its class from the
hook ``torchbay_register_trackers``; ``tracking.log_with`` (or ``Accelerator(log_with=...)``)
selects trackers by name, ``"all"`` selects every installed one. A name nothing registered is
an error before training starts, naming the distribution to install. See docs/tracking.md.

Hooks only find the classes: every per-run decision (where the logs go, checking the
tracker's own settings, creating the run, converting values) is a method of the selected
tracker class or object.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from torchbay.axes.tracker import GeneralTracker, TrackerError, takes_settings  # noqa: F401 (re-exported)
from torchbay.process.current import peek
from torchbay.registry.lazy_class import loaded
from torchbay.registry.manager import get_plugin_manager
from torchbay.registry.published import TRACKER
from torchbay.registry.published import install_hint as hint
from torchbay.registry.selection import check_selected
from torchbay.switch.finder import installed_finder
from torchbay.tracking.values import flatten, hparam_value, is_number, split_scalars, to_python  # noqa: F401 (re-exported)

log = logging.getLogger("torchbay")

#: the name ``log_with`` takes for "every installed tracker"
ALL = "all"
#: the built-in tracker's name and the file it writes in its run directory
JSONL_NAME = "jsonl"
JSONL_FILE = "metrics.jsonl"
JSONL_FORMAT = "torchbay-jsonl/1"


def on_main_process(function):
    """Accelerate's decorator for tracker methods: run on the main process only, unless the
    tracker's ``main_process_only`` is ``False``."""

    @functools.wraps(function)
    def execute(self, *args, **kwargs):
        if getattr(self, "main_process_only", False) and not _is_main_process():
            return None
        return function(self, *args, **kwargs)

    return execute


def _is_main_process() -> bool:
    run = peek()
    if run is not None:
        return run.is_main_process
    return int(os.environ.get("RANK", "0")) == 0


# --- choosing trackers ---------------------------------------------------------------------


def install_hint(name: str, installed=()) -> str:
    return hint(TRACKER, name, installed)


#: ``tracking.registry.LOGGER_TYPE_TO_CLASS`` once imported: the classes this process registered
process_registrations: Any = None


def registered(pm=None) -> dict[str, type[GeneralTracker]]:
    """Every installed tracker class by name (the built-in ``jsonl`` included), with the classes this process
    registered (``register_tracker_class``)."""
    if pm is None:
        pm = get_plugin_manager()
    plugins = pm.registries()["trackers"]
    return dict(plugins) if process_registrations is None else process_registrations.merged(plugins)


def select_trackers(names: Iterable[str], registry: Mapping[str, type[GeneralTracker]], pm=None,
                    setting: str = "tracking.log_with") -> tuple[list[type[GeneralTracker]], list[str]]:
    """The classes ``names`` select (``"all"``: every installed one that can run here) and the
    problems found: a name nothing registered (with the distribution to install), a tracker
    whose library cannot be imported."""
    chosen: list[type[GeneralTracker]] = []
    problems: list[str] = []
    for name in names:
        if name == ALL:
            for cls in registry.values():
                if not _reason(cls) and (cls := loaded(cls)) not in chosen:
                    chosen.append(cls)
            continue
        cls = registry.get(name)
        if cls is None:
            failed = [f"{i.name} ({i.distribution}: {i.error})" for i in pm.failed_plugins()] if pm else []
            message = (f"{setting}: tracker '{name}' is not installed (installed: {', '.join(sorted(registry))}); "
                       f"{install_hint(name, registry)}")
            problems.append(message + (f"; plugins that failed to load: {'; '.join(failed)}" if failed else ""))
            continue
        reason = _reason(cls)
        if reason:
            problems.append(f"{setting}: tracker '{name}' cannot run here: {reason}")
        elif (cls := loaded(cls)) not in chosen:  # a class registered lazily was imported by _reason
            chosen.append(cls)
    return chosen, problems


def _reason(cls: type[GeneralTracker]) -> str | None:
    try:
        return cls.unavailable_reason()
    except Exception as exc:
        return f"its plugin failed to say whether it can run ({type(exc).__name__}: {exc})"


def logging_base(config: Any) -> Path:
    """The directory under which every tracker writes by default: ``tracking.logging_dir``, else
    ``project.logging_dir``, else ``<project.project_dir>/logs``."""
    tracking = config.tracking
    if tracking.logging_dir:
        return Path(tracking.logging_dir)
    if config.project.logging_dir:
        return Path(config.project.logging_dir)
    return Path(config.project.project_dir) / "logs"


def tracking_problems(context: Any) -> list[str]:
    """The tracking section's problems for this run: names that select nothing, unusable
    trackers, the selected classes' own ``check``, a logging directory that is a file."""
    config = context.config
    registry = registered(context.pm)

    classes, problems = select_trackers(config.tracking.log_with, registry, context.pm)
    for cls in classes:
        check_selected(cls, context, problems, context.pm)
    problems += convention_problems(classes, context)
    if classes:
        base = logging_base(config)
        for cls in classes:
            where = cls.logging_dir_for(base, getattr(config, cls.name, None))
            blocker = next((p for p in [where, *where.parents] if p.exists()), None)
            if blocker is not None and not blocker.is_dir():
                problems.append(f"tracker '{cls.name}' would write under {where}, but {blocker} is a file; set "
                                f"tracking.logging_dir (or {cls.name}.logging_dir) to a directory")
    return problems


def where_logs_go(config: Any, registry: Mapping[str, type[GeneralTracker]]) -> dict[str, str]:
    """``{tracker name: directory}`` for the trackers ``config`` selects (``torchbay env``)."""
    classes, _ = select_trackers(config.tracking.log_with, registry)
    base = logging_base(config)
    return {cls.name: str(cls.logging_dir_for(base, getattr(config, cls.name, None))) for cls in classes}


# --- Accelerate's LoggerType ---------------------------------------------------------------


class _LoggerTypeMeta(type):
    """``LoggerType.MYTRACKER`` is the name ``"mytracker"`` when such a tracker is installed;
    otherwise an error naming the distribution to install. Iterating gives ``ALL`` and every
    installed tracker."""

    def __getattr__(cls, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        name = attr.lower()
        if name == ALL or name in registered():
            return cls(name)
        raise TrackerError(f"LoggerType.{attr}: tracker '{name}' is not installed (installed: "
                           f"{', '.join(sorted(registered()))}); {install_hint(name, registered())}")

    def __iter__(cls):
        return iter([cls(ALL), *(cls(name) for name in registered())])

    def __call__(cls, value: Any = ALL):
        return super().__call__(str(getattr(value, "value", value)))


class LoggerType(str, metaclass=_LoggerTypeMeta):
    """Accelerate's ``LoggerType``: ``LoggerType.ALL`` and one member per installed tracker
    (``LoggerType.JSONL`` for the built-in one). A member is its name."""

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        return self.value.upper()

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"<LoggerType.{self.name}: {self.value!r}>"


def split_log_with(log_with: Any) -> tuple[list[str] | None, list[GeneralTracker]]:
    """``Accelerator(log_with=...)`` as (names, or None when not given; tracker instances)."""
    if log_with is None:
        return None, []
    if isinstance(log_with, (str, GeneralTracker)) or not isinstance(log_with, (list, tuple, set)):
        items = [log_with]
    else:
        items = list(log_with)
    names, instances, bad = [], [], []
    for item in items:
        if isinstance(item, GeneralTracker):
            instances.append(item)
        elif isinstance(item, str):
            names += [part.strip() for part in str(getattr(item, "value", item)).split(",") if part.strip()]
        elif isinstance(getattr(item, "value", None), str):  # another enum of names (Accelerate's LoggerType)
            names.append(item.value)
        else:
            bad.append(repr(item))
    if bad:
        raise TrackerError(f"log_with: {', '.join(bad)} is not a tracker name, LoggerType or GeneralTracker "
                           f"instance (a class? pass an instance: log_with=[MyTracker(...)])")
    return names, instances


def say(message: str) -> None:
    """Tell the user (logger ``torchbay`` at INFO when it is shown, else one line on stderr)."""
    if log.isEnabledFor(logging.INFO) and (log.hasHandlers()):
        log.info("torchbay: %s", message)
    else:
        print(f"torchbay: {message}", file=sys.stderr, flush=True)


#: where Accelerate's logging directory may be set, first wins
LOGGING_DIR_SETTINGS = ("tracking.logging_dir", "project.logging_dir", "project.project_dir")


def follows_accelerate_layout(cls: type) -> bool:
    """Whether ``cls`` writes where Accelerate's trackers write (``<logging_dir>/<run>``, a logging directory
    required) rather than in torchbay's ``<logs>/<name>/<run>``: a class written to Accelerate's convention, and
    one whose ``accelerate_layout`` says so while torchbay answers ``import accelerate`` (code written for
    Accelerate finds its logs where Accelerate put them)."""
    if not takes_settings(cls):
        return True
    return getattr(cls, "accelerate_layout", False) and installed_finder() is not None


def accelerate_logging_dir(context: Any) -> str | None:
    """Accelerate's logging directory for this run: the first of :data:`LOGGING_DIR_SETTINGS` that was set."""
    sources = context.resolved.sources
    for dotted in LOGGING_DIR_SETTINGS:
        if sources.get(dotted, "defaults") != "defaults":
            section, key = dotted.split(".")
            value = getattr(getattr(context.config, section), key)
            if value:
                return str(value)
    return None


def convention_problems(classes: list[type], context: Any) -> list[str]:
    """Accelerate-convention classes that need a logging directory in a run that sets none."""
    if accelerate_logging_dir(context) is not None:
        return []
    return [f"Logging with `{cls.name}` requires a `logging_dir`: set project_dir (Accelerator(project_dir=...)) or "
            f"tracking.logging_dir" for cls in classes
            if getattr(cls, "requires_logging_directory", False) and follows_accelerate_layout(cls)]
