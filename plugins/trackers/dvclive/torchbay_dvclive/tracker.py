"""The ``dvclive`` tracker: DVCLive's plain files in ``<logging_dir>/<project_name>``.

The init config is ``params.yaml`` (nested as given, numpy and tensor values converted:
DVCLive itself cannot store a numpy int). Numbers are metrics at the step (nested names joined
with ``/``: ``plots/metrics/eval/loss.tsv``), ``metrics.json`` holds the latest. Strings are
metrics too, as DVCLive (and Accelerate's tracker) stores them; other values (lists, ``None``...),
which DVCLive refuses, go to ``text/<name>.tsv`` (step, JSON text) next to them.
A resumed run (the same directory) goes on appending, as DVCLive's ``resume=True`` does.

DVCLive's public ``Live`` is used as it is. Like every ``Live()`` (also under Accelerate), it runs
``dvc init`` in the Git repository around the working directory when that repository has no DVC set-up
yet (``.dvc/`` and ``.dvcignore`` at its root, staged in Git's index). DVCLive has no public switch to
skip it, and torchbay changes nothing it did not write unless asked: such a run is refused by
:meth:`DVCLiveTracker.check` (on every rank, before anything starts) unless ``dvclive.dvc_init`` (or
``dvclive.save_dvc_exp``, which needs DVC anyway) says yes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchbay.plugin import GeneralTracker, say, split_scalars, to_python


class DVCLiveTracker(GeneralTracker):
    name = "dvclive"
    library = "dvclive"
    requires_logging_directory = True

    def __init__(self, run_name: str | None = None, logging_dir: str | os.PathLike | None = None,
                 settings: Any = None, live: Any = None, **kwargs: Any):
        """``run_name`` and ``logging_dir`` as torchbay gives them (``<logging_dir>/<run_name>``); Accelerate's
        arguments too: ``dir`` (DVCLive's own: the run's directory, given by the user, wins) and ``live`` (a
        ``dvclive.Live`` the user built, used as it is)."""
        super().__init__()
        given = kwargs.pop("dir", None)
        self.dir = Path(given) if given else Path(logging_dir or ".") / (run_name or "dvclive")
        self.settings = settings
        self.kwargs = kwargs
        self.live = live
        self._ended = False


    @classmethod
    def check(cls, context: Any) -> list[str]:
        settings = getattr(context.config, "dvclive", None)
        if getattr(settings, "dvc_init", False) or getattr(settings, "save_dvc_exp", False):
            return []
        repository = git_root_dvclive_sets_up(Path.cwd())
        if repository is None:
            return []
        return [f"dvclive: DVCLive would run `dvc init` in the Git repository {repository} (.dvc/ and .dvcignore, "
                f"staged in Git), as every dvclive.Live() does; allow it with dvclive.dvc_init: true (--set "
                f"dvclive.dvc_init=true), or run `dvc init` there yourself, or start the run outside that repository"]

    def start(self) -> None:
        from dvclive import Live

        if self.live is not None:
            return
        save_dvc_exp = bool(getattr(self.settings, "save_dvc_exp", False))
        repository = git_root_dvclive_sets_up(Path.cwd())
        if repository is not None:  # allowed (check): say it as it happens
            say(f"dvclive: DVCLive runs `dvc init` in the Git repository {repository} (.dvc/ and .dvcignore, "
                f"staged in Git)")
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
            if isinstance(value, str):
                self.live.log_metric(name, value, **kwargs)
                continue
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
        """End the run; ``self.live`` stays, to read the run's files back (as Accelerate's tracker keeps it)."""
        if self.live is not None and not self._ended:
            self.live.end()
            self._ended = True


def git_root_dvclive_sets_up(start: Path) -> Path | None:
    """The Git repository DVCLive would ``dvc init`` from ``start``: None inside a DVC repository
    (a ``.dvc/`` folder here or above, as DVC looks for it) or outside Git."""
    folders = (start, *start.parents)
    if any((folder / ".dvc").is_dir() for folder in folders):
        return None
    return next((folder for folder in folders if (folder / ".git").exists()), None)
