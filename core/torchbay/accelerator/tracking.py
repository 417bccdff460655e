"""The Accelerator's experiment-tracking methods, with Accelerate's names: ``init_trackers``, ``log``,
``get_tracker``, ``trackers``, ``log_with`` (docs/tracking.md).

Mixin of :class:`~torchbay.accelerator.accelerator.Accelerator`. The trackers are the run's
:class:`~torchbay.tracking.run.RunTracking`, which the Accelerator holds as ``accelerator.tracking``; each method
here hands over to it, with whether this is the main process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.tracking.run import RunTracking
    from torchbay.tracking.trackers import GeneralTracker


class Tracking:
    """Accelerate's tracker methods of the Accelerator, over the run's trackers it holds."""

    #: the run's trackers (made by the Accelerator once the training state exists)
    tracking: RunTracking
    is_main_process: bool

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The running trackers of this process (empty on the other processes)."""
        return list(self.tracking.running)

    @property
    def log_with(self) -> list[Any]:
        return self.tracking.log_with

    def init_trackers(self, project_name: str, config: dict | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the selected trackers for run ``project_name`` on the main process, and record
        ``config`` (hyper-parameters, may be nested). ``init_kwargs={"<tracker>": {...}}`` goes
        to that tracker's constructor. Call on every process (it does nothing on the others)."""
        self.tracking.start(project_name, config, init_kwargs, main=self.is_main_process)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        """Log ``values`` at ``step`` (default: the step after the last one logged) to every tracker.

        Call it on every process: only the main process writes, and no process waits for another.
        ``log_kwargs={"<tracker>": {...}}`` goes to that tracker's ``log``.
        """
        self.tracking.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its backend's run object with ``unwrap=True``). On a process
        without trackers: a blank tracker that does nothing (as in Accelerate)."""
        return self.tracking.get(name, unwrap, main=self.is_main_process)
