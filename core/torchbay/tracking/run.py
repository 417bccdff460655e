"""The trackers of one run: :class:`RunTracking`, which the Accelerator holds as ``accelerator.tracking`` and whose
methods its ``init_trackers``, ``log``, ``get_tracker``, ``trackers`` and ``end_training`` hand over to
(docs/tracking.md).

Trackers run on the main process only (unless a tracker instance says ``main_process_only = False``); nothing
here is a collective, so logging never waits for another rank. A ``log`` without ``step`` takes the next step of
the run's own counter (``tracker_step`` of the training state), which ``save_state`` saves, so step numbers
continue after ``load_state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from torchbay.tracking.registry import accelerate_logging_dir, follows_accelerate_layout
from torchbay.tracking.trackers import GeneralTracker, TrackerError, logging_base, registered, say, select_trackers

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.context import RunContext
    from torchbay.checkpoint.inputs import TrainingState


class RunTracking:
    """The selected tracker classes and the user's tracker instances of a run, and the trackers started from them.

    ``context``: the run's (its config's ``tracking`` section, the plugin manager for the registered classes);
    ``counters``: the :class:`~torchbay.checkpoint.inputs.TrainingState` whose ``tracker_step`` ``log`` advances;
    ``instances``: trackers the user built (``Accelerator(log_with=[tracker])``). ``phase`` goes new -> started ->
    finished.
    """

    def __init__(self, context: RunContext, counters: TrainingState, instances: Iterable[GeneralTracker] = ()):
        classes, problems = select_trackers(context.config.tracking.log_with, registered(context.pm), context.pm)
        if problems:  # (validation reported them already; a config built elsewhere may skip it)
            raise TrackerError(problems[0])
        self.context = context
        self.counters = counters
        self.classes: list[type[GeneralTracker]] = classes
        self.instances: list[GeneralTracker] = list(instances)
        self.running: list[GeneralTracker] = []
        self.phase = "new"

    @property
    def log_with(self) -> list[Any]:
        return [*(cls.name for cls in self.classes), *self.instances]

    def start(self, project_name: str, config: dict | None = None,
              init_kwargs: dict[str, dict[str, Any]] | None = None, *, main: bool) -> None:
        """``init_trackers``: start the trackers for run ``project_name`` (the selected classes on the ``main``
        process only) and record ``config`` in each."""
        init_kwargs = dict(init_kwargs or {})
        if self.phase != "new":
            raise TrackerError(f"init_trackers was already called in this run ({self.phase}); call it "
                               f"once, before the first accelerator.log")
        if not isinstance(project_name, str) or not project_name or "/" in project_name or project_name in (".", ".."):
            raise TrackerError(f"init_trackers(project_name={project_name!r}): give the run a name without '/' "
                               f"(it names a directory under each tracker's logging directory)")
        names = [cls.name for cls in self.classes] + [t.name for t in self.instances]
        unknown = sorted(set(init_kwargs) - set(names))
        if unknown:
            raise TrackerError(f"init_trackers(init_kwargs=...) names {', '.join(unknown)}, which this run does not "
                               f"log to (trackers: {', '.join(names) or 'none'}); set tracking.log_with or remove them")
        self.phase = "started"
        started: list[GeneralTracker] = []
        try:
            if main:
                for cls in self.classes:
                    settings = getattr(self.context.config, cls.name, None)
                    tracker = cls.create(project_name, self.directory_for(cls, settings), settings,
                                         dict(init_kwargs.get(cls.name, {})))
                    tracker.start()
                    started.append(tracker)
            for tracker in self.instances:  # built by the user; started here, as Accelerate does
                if main or not tracker.main_process_only:
                    started.append(tracker)
                    tracker.start()
            if config is not None:
                for tracker in started:
                    tracker.store_init_configuration(config)
        except BaseException:
            for tracker in started:  # close what was opened; the error says what went wrong
                try:
                    tracker.finish()
                except Exception:
                    pass
            self.phase = "new"
            raise
        self.running = started
        if main and started:
            where = "; ".join(f"{t.name}: {t.location or '(its own store)'}" for t in started)
            say(f"tracking run '{project_name}' with {where}")

    def directory_for(self, cls: type[GeneralTracker], settings: Any) -> Any:
        """Where a tracker class writes: torchbay's own trackers in ``<logs>/<name>``; a class following
        Accelerate's convention, or any under the switch, in Accelerate's logging directory (tracking/trackers.py)."""
        if follows_accelerate_layout(cls):
            return accelerate_logging_dir(self.context)
        return cls.logging_dir_for(logging_base(self.context.config), settings)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        """``accelerator.log``: ``values`` at ``step`` (default: the step after the last one logged) to every
        running tracker; ``log_kwargs={"<tracker>": {...}}`` goes to that tracker's ``log``."""
        if not self.classes and not self.instances:
            return  # no tracker selected: as in Accelerate, logging does nothing
        if self.phase != "started":
            what = ("init_trackers(project_name) was not called" if self.phase == "new"
                    else "end_training() already finished the trackers")
            raise TrackerError(f"accelerator.log: {what}; call init_trackers before logging")
        if not isinstance(values, dict):
            raise TrackerError(f"accelerator.log takes a dict of values, not {type(values).__name__}")
        if step is None:
            step = self.counters.tracker_step
        elif not isinstance(step, int) or isinstance(step, bool) or step < 0:
            step = _as_step(step)
        self.counters.tracker_step = max(self.counters.tracker_step, step + 1)
        log_kwargs = log_kwargs or {}
        for tracker in self.running:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False, *, main: bool) -> Any:
        """``get_tracker``: the tracker called ``name`` (its backend's run object with ``unwrap=True``); on a
        process without trackers a blank tracker that does nothing (as in Accelerate)."""
        name = str(getattr(name, "value", name))
        if not self.running:
            if main and self.phase == "started":
                raise TrackerError(f"get_tracker({name!r}): this run logs to no tracker")
            return GeneralTracker(_blank=True)
        for tracker in self.running:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise TrackerError(f"get_tracker({name!r}): not a tracker of this run (trackers: "
                           f"{', '.join(t.name for t in self.running)})")

    def finish(self) -> None:
        """Finish every tracker (close files), once; the first error is raised after all were tried. The finished
        trackers stay in ``running`` (as in Accelerate: their files can be read back)."""
        if self.phase != "started":
            return
        self.phase = "finished"
        first: BaseException | None = None
        for tracker in self.running:
            try:
                tracker.finish()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first


def _as_step(step: Any) -> int:
    try:
        value = int(getattr(step, "item", lambda: step)())
    except (TypeError, ValueError):
        value = -1
    if value < 0 or isinstance(step, bool):
        raise TrackerError(f"accelerator.log(step={step!r}): step must be a whole number >= 0")
    return value
