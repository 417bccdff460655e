"""The ``mlflow`` tracker: one MLflow run per ``init_trackers``, written with ``MlflowClient``.

No global MLflow state is touched (no ``mlflow.set_tracking_uri``, no active run): the tracker
talks to its own client. By default the store is ``sqlite:///<logging_dir>/mlflow.db`` with
artifacts in ``<logging_dir>/artifacts``, so nothing lands in the working directory.

Values: numbers (tensors and numpy scalars included) are metrics at the step, nested names
joined with ``/``; strings and other values are text artifacts ``<name>/step_<step>.txt``
(MLflow metrics hold numbers only). The init config is logged as params (flattened; values
that are not numbers, strings or bools as JSON text; a value longer than MLflow's limit is cut
there) and, whole, as the artifact ``config.json``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from torchbay.plugin import GeneralTracker, TrackerError, flatten, hparam_value, split_scalars, to_python

#: MLflow's limit on a param value's length
PARAM_LIMIT = 6000
SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks")


class MLflowTracker(GeneralTracker):
    name = "mlflow"
    library = "mlflow"
    requires_logging_directory = True

    def __init__(self, project_name: str, logging_dir: str | os.PathLike | None = None, settings: Any = None,
                 **kwargs: Any):
        super().__init__()
        unknown = set(kwargs) - {"run_name", "tags", "description"}
        if unknown:
            raise TrackerError(f"init_kwargs['mlflow'] has {', '.join(sorted(unknown))}; it takes run_name, tags "
                               f"and description (the store is set in the mlflow config section)")
        self.project = project_name
        self.logging_dir = Path(logging_dir or ".").absolute()
        self.tracking_uri = (getattr(settings, "tracking_uri", None) or
                             f"sqlite:///{self.logging_dir / 'mlflow.db'}")
        self.experiment_name = getattr(settings, "experiment_name", None) or project_name
        self.kwargs = kwargs
        self.client = None
        self.run_id: str | None = None


    @classmethod
    def check(cls, context: Any) -> list[str]:
        uri = context.config.mlflow.tracking_uri
        if uri is not None and uri.split(":", 1)[0].split("+", 1)[0] not in SCHEMES:
            return [f"mlflow.tracking_uri {uri!r} is not a store URI: use sqlite:///path/mlflow.db, "
                    f"file:///path/mlruns or http://host:port (or leave it unset: sqlite in the logging dir)"]
        return []

    def start(self) -> None:
        from mlflow.tracking import MlflowClient

        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # chosen explicitly in mlflow.tracking_uri
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (self.logging_dir / "artifacts").as_uri() if self.tracking_uri.startswith("sqlite:") else None
            experiment_id = self.client.create_experiment(self.experiment_name, artifact_location=artifacts)
        tags = {str(k): str(v) for k, v in (self.kwargs.get("tags") or {}).items()}
        if self.kwargs.get("description"):
            tags["mlflow.note.content"] = str(self.kwargs["description"])
        run = self.client.create_run(experiment_id, run_name=self.kwargs.get("run_name"), tags=tags)
        self.run_id = run.info.run_id

    @property
    def tracker(self) -> Any:
        """The MLflow run (``mlflow.entities.Run``, as it is now); ``self.client`` writes to it."""
        return self.client.get_run(self.run_id) if self.client is not None and self.run_id else None

    @property
    def location(self) -> str:
        return f"{self.tracking_uri} (experiment '{self.experiment_name}', run {self.run_id})"

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        values = to_python(dict(values))
        params = [Param(key, str(hparam_value(value))[:PARAM_LIMIT]) for key, value in flatten(values).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_dict(self.run_id, values, "config.json")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from mlflow.entities import Metric

        numbers, others = split_scalars(values)
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step or 0) for key, value in numbers.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000], **kwargs)
        for key, value in others.items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            self.client.log_text(self.run_id, text, f"{key}/step_{step or 0:08d}.txt")

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, image in values.items():
            image = image.detach().cpu().numpy() if hasattr(image, "detach") else image
            self.client.log_image(self.run_id, image, key=key, step=step or 0, **kwargs)

    def finish(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.client = None
