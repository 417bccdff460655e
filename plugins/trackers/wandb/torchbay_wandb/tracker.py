"""The ``wandb`` tracker: one W&B run per ``init_trackers``, in ``<logging_dir>/wandb``.

Values are logged with nested names joined by ``/`` (W&B groups panels by that prefix) and
converted to plain Python (tensors, numpy scalars); the init config is ``run.config``, nested
as given. ``init_kwargs={"wandb": {...}}`` goes to ``wandb.init`` (e.g. ``group``, ``tags``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchbay.plugin import GeneralTracker, TrackerError, flatten, to_python


class WandBTracker(GeneralTracker):
    name = "wandb"
    library = "wandb"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, settings: Any = None,
                 **kwargs: Any):
        super().__init__()
        for key in ("dir", "project"):
            if key in kwargs:
                raise TrackerError(f"init_kwargs['wandb']['{key}']: set it with "
                                   f"{'wandb.logging_dir' if key == 'dir' else 'init_trackers(project_name)'} instead")
        self.project = run_name  # Accelerate's name for it: the project of the run
        self.logging_dir = Path(logging_dir or ".").absolute()
        self.settings = settings
        self.kwargs = kwargs
        self.run = None


    def start(self) -> None:
        import wandb

        options = dict(self.kwargs)
        if self.settings is not None:
            if self.settings.mode is not None:
                options.setdefault("mode", self.settings.mode)
            if self.settings.entity is not None:
                options.setdefault("entity", self.settings.entity)
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, dir=str(self.logging_dir), **options)

    @property
    def tracker(self) -> Any:
        return self.run

    @property
    def location(self) -> str:
        if self.run is None:
            return str(self.logging_dir)
        return str(Path(self.run.dir).parent)  # .../wandb/<offline-run-...>; its run-<id>.wandb holds the records

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(to_python(dict(values)), allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(flatten(values), step=step, **kwargs)

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import wandb

        images = {key: [wandb.Image(image) for image in value] if isinstance(value, (list, tuple))
                  else wandb.Image(value) for key, value in values.items()}
        self.run.log(images, step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


#: the name this class had before it took Accelerate's
WandbTracker = WandBTracker
