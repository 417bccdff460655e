"""The contract of a tracker plugin: :class:`GeneralTracker` (Accelerate's names), the base every tracker
subclasses, and :class:`TrackerError`. The hook that registers trackers (:mod:`torchbay.hookspecs`) and the
choosing of trackers by name (:mod:`torchbay.tracking.trackers`) build on it."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any

from torchbay.errors import TorchbayError


class TrackerError(TorchbayError, ValueError):
    """A tracker was asked for something it cannot do (unknown name, bad arguments, wrong order)."""


# --- the interface -------------------------------------------------------------------------


class GeneralTracker:
    """Base of every tracker, with Accelerate's names (``accelerate.tracking.GeneralTracker``).

    A subclass sets ``name`` and ``requires_logging_directory`` and overrides what its backend
    supports: ``start`` (create the run), ``store_init_configuration`` (hyper-parameters),
    ``log`` (scalars and other values at a step), ``log_images``, ``finish`` (close files) and
    the ``tracker`` property (the backend's own run object, ``get_tracker(name, unwrap=True)``).

    A registered tracker class is also asked, before training starts and only when selected:
    ``unavailable_reason()`` (its library cannot be imported), ``check(context)`` (its own
    settings: the config section named after the tracker) and ``logging_dir_for(base,
    settings)`` (where it writes; by default ``<base>/<name>``, or the section's ``logging_dir``).
    On the main process torchbay then builds it with ``create(run_name, logging_dir, settings,
    init_kwargs)`` and calls ``start()``. An instance passed in ``log_with`` is built by the user; ``init_trackers``
    calls its ``start()`` too (as Accelerate does), on the processes it runs on.

    Only the main process runs a tracker unless its ``main_process_only`` is ``False``.
    """

    #: the name ``log_with`` selects it by (a registered class must set it)
    name: str = ""
    #: whether ``create`` passes it a logging directory (Accelerate's attribute)
    requires_logging_directory: bool = False
    #: run only on the main process (Accelerate's attribute)
    main_process_only: bool = True
    #: while torchbay answers ``import accelerate``, write in Accelerate's ``<logging_dir>/<run>`` (and require
    #: a logging directory) as Accelerate's tracker of the same name does, instead of ``<logs>/<name>/<run>``
    accelerate_layout: bool = False
    #: import name of the tracking library (checked cheaply, never imported); ``None``: none needed
    library: str | None = None

    def __init__(self, _blank: bool = False):
        if not _blank and not getattr(self, "name", ""):
            raise TrackerError(f"{type(self).__name__} must set the class attribute 'name' (the name "
                               f"get_tracker and the logs use)")

    # -- before the run: class methods of the selected classes -------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this tracker cannot run here (its ``library`` is not importable), or ``None``."""
        if cls.library and importlib.util.find_spec(cls.library) is None:
            return f"the {cls.library} package is not installed: pip install {cls.library}"
        return None

    @classmethod
    def check(cls, context: Any) -> list[str]:
        """Problems with this tracker's own settings for the run, each naming the setting and the fix."""
        return []

    @classmethod
    def logging_dir_for(cls, base: Path, settings: Any = None) -> Path:
        """Where this tracker writes: the ``logging_dir`` of its config section when set, else
        ``<base>/<name>`` (``base`` is ``tracking.logging_dir``, see :func:`logging_base`)."""
        own = getattr(settings, "logging_dir", None)
        return Path(own) if own else Path(base) / cls.name

    @classmethod
    def create(cls, run_name: str, logging_dir: Path, settings: Any, init_kwargs: dict[str, Any]) -> GeneralTracker:
        """Build the tracker for this run (main process). ``settings`` is the tracker's config
        section (``None`` without one); ``init_kwargs`` is ``init_trackers(init_kwargs={name: ...})``.
        The default calls ``cls(run_name, logging_dir, settings=settings, **init_kwargs)``; for a class whose
        constructor takes no ``settings`` (Accelerate's convention), ``cls(run_name, logging_dir, **init_kwargs)``
        when it ``requires_logging_directory``, else ``cls(run_name, **init_kwargs)``."""
        if takes_settings(cls):
            return cls(run_name, logging_dir, settings=settings, **init_kwargs)
        if cls.requires_logging_directory:
            return cls(run_name, str(logging_dir), **init_kwargs)
        return cls(run_name, **init_kwargs)

    # -- the run ---------------------------------------------------------------------------
    def start(self) -> None:
        """Create the backend's run (called once, on the main process, by ``init_trackers``)."""

    @property
    def tracker(self) -> Any:
        """The backend's own run object (``get_tracker(name, unwrap=True)``)."""
        return None

    @property
    def location(self) -> str:
        """Where this tracker's logs are, for the first log line and ``torchbay env``."""
        return ""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's configuration (hyper-parameters); may be nested."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (scalars, strings, nested dicts, tensors) at ``step``."""

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        raise TrackerError(f"tracker '{self.name}' cannot log images")

    def finish(self) -> None:
        """Flush and close (``end_training``)."""


def takes_settings(cls: type) -> bool:
    """Whether ``cls``'s constructor takes torchbay's ``settings`` (its config section); if not, it follows
    Accelerate's convention."""
    try:
        return "settings" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
