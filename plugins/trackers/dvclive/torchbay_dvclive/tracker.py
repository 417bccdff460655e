"""The ``dvclive`` tracker: DVCLive's plain files in ``<logging_dir>/<project_name>``.

The init config is ``params.yaml`` (nested as given, numpy and tensor values converted:
DVCLive itself cannot store a numpy int). Numbers are metrics at the step (nested names joined
with ``/``: ``plots/metrics/eval/loss.tsv``), ``metrics.json`` holds the latest. DVCLive
stores numbers only; other values go to ``text/<name>.tsv`` (step, JSON text) next to them.
A resumed run (the same directory) goes on appending, as DVCLive's ``resume=True`` does.

DVCLive runs ``dvc init`` in the enclosing Git repository when it finds no DVC repository
(``.dvc/`` and ``.dvcignore`` at the repository root), even when no DVC experiment is saved.
Unless ``dvclive.save_dvc_exp`` asks for an experiment, the tracker skips that set-up and
writes nothing outside its own directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchbay.tracking import GeneralTracker, TrackerError, split_scalars, to_python


class DVCLiveTracker(GeneralTracker):
    name = "dvclive"
    library = "dvclive"
    requires_logging_directory = True

    def __init__(self, project_name: str, logging_dir: str | os.PathLike | None = None, settings: Any = None,
                 **kwargs: Any):
        super().__init__()
        if "dir" in kwargs:
            raise TrackerError("init_kwargs['dvclive']['dir']: set dvclive.logging_dir (or tracking.logging_dir)")
        self.dir = Path(logging_dir or ".") / project_name
        self.settings = settings
        self.kwargs = kwargs
        self.live = None


    def start(self) -> None:
        save_dvc_exp = bool(getattr(self.settings, "save_dvc_exp", False))
        Live = _files_only_live(save_dvc_exp)
        options = {"resume": True, "save_dvc_exp": save_dvc_exp, "dvcyaml": None, "report": None}
        options.update(self.kwargs)
        self.live = Live(dir=str(self.dir), **options)

    @property
    def tracker(self) -> Any:
        return self.live

    @property
    def location(self) -> str:
        return str(self.dir)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.live.log_params(to_python(dict(values)))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        numbers, others = split_scalars(values)
        if step is not None:
            self.live.step = step
        for name, value in numbers.items():
            self.live.log_metric(name, value, **kwargs)
        for name, value in others.items():
            path = self.dir / "text" / f"{name}.tsv"
            path.parent.mkdir(parents=True, exist_ok=True)
            new = not path.exists()
            with open(path, "a", encoding="utf-8") as f:
                if new:
                    f.write("step\tvalue\n")
                f.write(f"{self.live.step}\t{json.dumps(value, default=str)}\n")
        self.live.make_summary()

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.live.step = step
        for name, image in values.items():
            image = image.detach().cpu().numpy() if hasattr(image, "detach") else image
            self.live.log_image(name if "." in name else f"{name}.png", image)

    def finish(self) -> None:
        if self.live is not None:
            self.live.end()
            self.live = None


#: the private methods of DVCLive's ``Live`` that the tracker replaces (see the module docstring)
_REPLACED = ("_init_dvc", "_init_dvc_file")


def _files_only_live(save_dvc_exp: bool):
    """DVCLive's ``Live`` without its DVC-repository set-up unless an experiment is saved."""
    from dvclive import Live

    missing = [name for name in _REPLACED if not callable(getattr(Live, name, None))]
    if missing and not save_dvc_exp:  # the override would do nothing and DVCLive could `dvc init` the user's repo
        from importlib.metadata import version

        raise TrackerError(f"dvclive {version('dvclive')} has no Live.{', Live.'.join(missing)}, which torchbay-dvclive "
                           f"replaces so that DVCLive writes nothing outside its own directory (no `dvc init` in your "
                           f"Git repository); install the dvclive version torchbay-dvclive was tested with "
                           f"(pip install 'dvclive==3.49.1'), or set dvclive.save_dvc_exp: true to let DVCLive set up "
                           f"DVC itself")

    class FilesOnlyLive(Live):
        def _init_dvc(self):
            if self._save_dvc_exp or os.getenv("DVC_ROOT"):  # a DVC experiment or a `dvc exp run` stage
                return super()._init_dvc()
            self._dvc_file = self._init_dvc_file()  # (unused: dvcyaml is None) no `dvc init`, no Git lookup
            return None

    return FilesOnlyLive
