"""The ``trackio`` tracker: one Trackio run per ``init_trackers``, in a local store under the run's
logging directory.

Trackio reads its store location (``TRACKIO_DIR``) once, when it is imported; the tracker sets
it before the first import in the process. If Trackio was imported earlier with another
directory, ``start`` says so instead of writing elsewhere. Values are converted to plain Python
(Trackio drops tensors), nested names joined with ``/``; the init config is the run's config.
The Trackio run is created at the first config or log call (Trackio takes the config when a
run starts).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from torchbay.plugin import GeneralTracker, TrackerError, flatten, to_python


class TrackioTracker(GeneralTracker):
    name = "trackio"
    library = "trackio"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, settings: Any = None,
                 **kwargs: Any):
        super().__init__()
        if "project" in kwargs or "config" in kwargs:
            raise TrackerError("init_kwargs['trackio']: the project is init_trackers' name and the config its "
                               "config argument; remove them")
        self.project = run_name  # Accelerate's name for it: the project of the run
        self.store = Path(logging_dir or ".").absolute()
        self.settings = settings
        self.kwargs = kwargs
        self.run = None


    def start(self) -> None:
        if "trackio" in sys.modules:
            from trackio.utils import TRACKIO_DIR

            if Path(TRACKIO_DIR).absolute() != self.store:
                raise TrackerError(f"trackio was imported before init_trackers and writes to {TRACKIO_DIR}; set "
                                   f"trackio.logging_dir to {TRACKIO_DIR}, or import trackio after init_trackers "
                                   f"(it reads TRACKIO_DIR once, at import)")
        else:
            os.environ["TRACKIO_DIR"] = str(self.store)
        self.store.mkdir(parents=True, exist_ok=True)

    def _ensure_run(self, config: dict[str, Any] | None = None) -> Any:
        if self.run is None:
            import trackio

            options = {"embed": False, "auto_log_gpu": False, "auto_log_cpu": False}
            for key in ("space_id", "server_url"):
                if getattr(self.settings, key, None):
                    options[key] = getattr(self.settings, key)
            options.update(self.kwargs)
            self.run = trackio.init(project=self.project, config=config, **options)
        return self.run

    @property
    def tracker(self) -> Any:
        return self.run

    @property
    def location(self) -> str:
        return str(self.store / f"{self.project}.db")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            raise TrackerError("trackio takes the config when its run starts: pass config= to init_trackers")
        self._ensure_run(to_python(dict(values)))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._ensure_run().log(flatten(values), step=step, **kwargs)

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import trackio

        images = {key: trackio.Image(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
                  for key, value in values.items()}
        self._ensure_run().log(images, step=step, **kwargs)

    def finish(self) -> None:
        if self.run is None:
            return
        from trackio import context_vars

        try:
            self.run.finish()
        finally:
            if context_vars.current_run.get() is self.run:
                context_vars.current_run.set(None)
            self.run = None
