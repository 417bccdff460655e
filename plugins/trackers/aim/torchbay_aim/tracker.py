"""The ``aim`` tracker: one Aim run per ``init_trackers`` in the repository ``<logging_dir>``.

The init config is ``run["hparams"]`` (nested as given, values converted); numbers are tracked
at the step (nested names joined with ``/``), strings as ``aim.Text``. ``log_kwargs={"aim":
{"context": {...}}}`` sets Aim's context. Look at it with ``aim up --repo <logging_dir>``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchbay.plugin import GeneralTracker, TrackerError, split_scalars, to_python


class AimTracker(GeneralTracker):
    name = "aim"
    library = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, settings: Any = None,
                 **kwargs: Any):
        """``repo`` (Aim's own argument, as Accelerate passes it on) is the repository and wins over
        ``logging_dir``."""
        super().__init__()
        if "experiment" in kwargs:
            raise TrackerError("init_kwargs['aim']['experiment']: the experiment is init_trackers' name; remove it")
        self.project = run_name
        self.repo = Path(kwargs.pop("repo", None) or logging_dir or ".").absolute()
        self.settings = settings
        self.kwargs = kwargs
        self.run = None


    def start(self) -> None:
        from aim import Run

        options = {"system_tracking_interval": getattr(self.settings, "system_tracking_interval", None),
                   "log_system_params": False, "capture_terminal_logs": False}
        options.update(self.kwargs)
        self.repo.mkdir(parents=True, exist_ok=True)
        self.run = Run(repo=str(self.repo), experiment=self.project, **options)

    @property
    def tracker(self) -> Any:
        return self.run

    @property
    def location(self) -> str:
        return f"{self.repo} (run {self.run.hash if self.run is not None else '?'})"

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run["hparams"] = to_python(dict(values))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from aim import Text

        numbers, others = split_scalars(values)
        for name, value in numbers.items():
            self.run.track(value, name=name, step=step, **kwargs)
        for name, value in others.items():
            self.run.track(Text(value if isinstance(value, str) else repr(value)), name=name, step=step, **kwargs)

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from aim import Image

        for name, image in values.items():
            image = image.detach().cpu().numpy() if hasattr(image, "detach") else image
            self.run.track(Image(image), name=name, step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None
