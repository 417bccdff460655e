"""The ``tensorboard`` tracker: scalars, text, images and hyper-parameters in TensorBoard event files.

Written with ``torch.utils.tensorboard.SummaryWriter`` (imported in ``start``, on the main
process only). Nested values are flattened with ``/`` (``{"eval": {"loss": x}}`` -> tag
``eval/loss``); tensors and numpy scalars become numbers; strings become text. The init
config goes to the HParams plugin (nested keys flattened, lists and other values as JSON
text, which ``add_hparams`` would refuse) and, whole, as the text ``config``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchbay.plugin import GeneralTracker, TrackerError, flatten, hparam_value, split_scalars, to_python


class TensorBoardTracker(GeneralTracker):
    name = "tensorboard"
    library = "tensorboard"
    requires_logging_directory = True
    accelerate_layout = True  # under the switch: <logging_dir>/<run>, as Accelerate's TensorBoardTracker

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, settings: Any = None,
                 **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.logging_dir = Path(logging_dir or ".") / run_name
        self.settings = settings
        self.kwargs = kwargs  # SummaryWriter's own arguments (init_kwargs={"tensorboard": {...}})
        self.writer = None


    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        options = {}
        if self.settings is not None:
            options = {"flush_secs": self.settings.flush_secs, "max_queue": self.settings.max_queue}
        options.update(self.kwargs)
        try:
            self.writer = SummaryWriter(log_dir=str(self.logging_dir), **options)
        except TypeError as exc:
            raise TrackerError(f"init_kwargs['tensorboard']: {exc} (they go to SummaryWriter)") from None

    @property
    def tracker(self) -> Any:
        return self.writer

    @property
    def location(self) -> str:
        return str(self.logging_dir)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        values = to_python(dict(values))
        hparams = {key: hparam_value(value) for key, value in flatten(values).items()}
        self.writer.add_hparams(hparams, metric_dict={}, run_name=".")
        self.writer.add_text("config", "```\n" + json.dumps(values, indent=2, sort_keys=True) + "\n```")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        numbers, others = split_scalars(values)
        for tag, value in numbers.items():
            self.writer.add_scalar(tag, value, global_step=step, **kwargs)
        for tag, value in others.items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            self.writer.add_text(tag, text, global_step=step)
        self.writer.flush()

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for tag, images in values.items():
            self.writer.add_images(tag, images, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
