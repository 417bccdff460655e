"""The Accelerator's experiment-tracking methods, with Accelerate's names: ``init_trackers``,
``log``, ``get_tracker``, ``trackers`` (docs/tracking.md).

Trackers run on the main process only (unless a tracker instance says ``main_process_only =
False``); nothing here is a collective, so logging never waits for another rank. A call to
``log`` without ``step`` takes the next step of the accelerator's own counter, which is saved
in ``save_state``'s training state, so step numbers continue after ``load_state``.
"""

from __future__ import annotations

from typing import Any

from torchbay.tracking.registry import accelerate_logging_dir, follows_accelerate_layout
from torchbay.tracking.trackers import (
    GeneralTracker,
    TrackerError,
    logging_base,
    registered,
    say,
    select_trackers,
    split_log_with,
)


class Tracking:
    """Mixin of :class:`~torchbay.accelerator.accelerator.Accelerator`."""

    def _setup_tracking(self, instances: list[GeneralTracker]) -> None:
        classes, problems = select_trackers(self.config.tracking.log_with, registered(self.pm), self.pm)
        if problems:  # (validation reported them already; a config built elsewhere may skip it)
            raise TrackerError(problems[0])
        self._tracker_classes = classes
        self._tracker_instances = list(instances)
        self._trackers: list[GeneralTracker] = []
        self._trackers_state = "new"  # new -> started -> finished
        # ``tracker_step`` (the step ``log`` uses when given none) lives in the training state (checkpointed.py)

    @staticmethod
    def _log_with_names(log_with: Any) -> tuple[list[str] | None, list[GeneralTracker]]:
        return split_log_with(log_with)

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The running trackers of this process (empty on the other processes)."""
        return list(self._trackers)

    @property
    def log_with(self) -> list[Any]:
        return [*(cls.name for cls in self._tracker_classes), *self._tracker_instances]

    def init_trackers(self, project_name: str, config: dict | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the selected trackers for run ``project_name`` on the main process, and record
        ``config`` (hyper-parameters, may be nested). ``init_kwargs={"<tracker>": {...}}`` goes
        to that tracker's constructor. Call on every process (it does nothing on the others)."""
        init_kwargs = dict(init_kwargs or {})
        if self._trackers_state != "new":
            raise TrackerError(f"init_trackers was already called in this run ({self._trackers_state}); call it "
                               f"once, before the first accelerator.log")
        if not isinstance(project_name, str) or not project_name or "/" in project_name or project_name in (".", ".."):
            raise TrackerError(f"init_trackers(project_name={project_name!r}): give the run a name without '/' "
                               f"(it names a directory under each tracker's logging directory)")
        names = [cls.name for cls in self._tracker_classes] + [t.name for t in self._tracker_instances]
        unknown = sorted(set(init_kwargs) - set(names))
        if unknown:
            raise TrackerError(f"init_trackers(init_kwargs=...) names {', '.join(unknown)}, which this run does not "
                               f"log to (trackers: {', '.join(names) or 'none'}); set tracking.log_with or remove them")
        self._trackers_state = "started"
        main = self.is_main_process
        started: list[GeneralTracker] = []
        try:
            if main:
                for cls in self._tracker_classes:
                    settings = getattr(self.config, cls.name, None)
                    tracker = cls.create(project_name, self._tracker_dir(cls, settings), settings,
                                         dict(init_kwargs.get(cls.name, {})))
                    tracker.start()
                    started.append(tracker)
            for tracker in self._tracker_instances:  # built by the user; started here, as Accelerate does
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
            self._trackers_state = "new"
            raise
        self._trackers = started
        if main and started:
            where = "; ".join(f"{t.name}: {t.location or '(its own store)'}" for t in started)
            say(f"tracking run '{project_name}' with {where}")

    def _tracker_dir(self, cls: type[GeneralTracker], settings: Any) -> Any:
        """Where a tracker class writes: torchbay's own trackers in ``<logs>/<name>``; a class following
        Accelerate's convention, or any under the switch, in Accelerate's logging directory (tracking/trackers.py)."""
        if follows_accelerate_layout(cls):
            return accelerate_logging_dir(self.context)
        return cls.logging_dir_for(logging_base(self.config), settings)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        """Log ``values`` at ``step`` (default: the step after the last one logged) to every tracker.

        Call it on every process: only the main process writes, and no process waits for another.
        ``log_kwargs={"<tracker>": {...}}`` goes to that tracker's ``log``.
        """
        if not self._tracker_classes and not self._tracker_instances:
            return  # no tracker selected: as in Accelerate, logging does nothing
        if self._trackers_state != "started":
            what = ("init_trackers(project_name) was not called" if self._trackers_state == "new"
                    else "end_training() already finished the trackers")
            raise TrackerError(f"accelerator.log: {what}; call init_trackers before logging")
        if not isinstance(values, dict):
            raise TrackerError(f"accelerator.log takes a dict of values, not {type(values).__name__}")
        if step is None:
            step = self.tracker_step
        elif not isinstance(step, int) or isinstance(step, bool) or step < 0:
            step = _as_step(step)
        self.tracker_step = max(self.tracker_step, step + 1)
        log_kwargs = log_kwargs or {}
        for tracker in self._trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its backend's run object with ``unwrap=True``). On a process
        without trackers: a blank tracker that does nothing (as in Accelerate)."""
        name = str(getattr(name, "value", name))
        if not self._trackers:
            if self.is_main_process and self._trackers_state == "started":
                raise TrackerError(f"get_tracker({name!r}): this run logs to no tracker")
            return GeneralTracker(_blank=True)
        for tracker in self._trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise TrackerError(f"get_tracker({name!r}): not a tracker of this run (trackers: "
                           f"{', '.join(t.name for t in self._trackers)})")

    def _finish_trackers(self) -> None:
        """Finish every tracker (close files), once; the first error is raised after all were tried. The finished
        trackers stay in ``accelerator.trackers`` (as in Accelerate: their files can be read back)."""
        if self._trackers_state != "started":
            return
        self._trackers_state = "finished"
        trackers = self._trackers
        first: BaseException | None = None
        for tracker in trackers:
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
