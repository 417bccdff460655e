"""The ``mlflow`` tracker: one MLflow run per ``init_trackers``, written with ``MlflowClient``.

No global MLflow state is touched (no ``mlflow.set_tracking_uri``, no active run): the tracker
talks to its own client. The store is the ``mlflow`` section's ``tracking_uri``, else the one MLflow
itself was given (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``), else
``sqlite:///<logging_dir>/mlflow.db`` with artifacts in ``<logging_dir>/artifacts``, so nothing lands
in the working directory.

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
#: what MLFLOW_NESTED_RUN reads as true (anything else is false)
TRUE = ("1", "true", "yes", "on", "y", "t")


class MLflowTracker(GeneralTracker):
    """Accelerate's arguments, each overridden by MLflow's own environment variable as in Accelerate
    (``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` (JSON), ``MLFLOW_NESTED_RUN``); the
    ``mlflow`` config section (``settings``) wins over both."""

    name = "mlflow"
    library = "mlflow"
    requires_logging_directory = True

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike | None = None,
                 run_id: str | None = None, tags: dict[str, Any] | str | None = None, nested_run: bool = False,
                 run_name: str | None = None, description: str | None = None, settings: Any = None,
                 **kwargs: Any):
        super().__init__()
        if kwargs:
            raise TrackerError(f"init_kwargs['mlflow'] has {', '.join(sorted(kwargs))}; it takes run_name, tags, "
                               f"description, run_id and nested_run (the store is set in the mlflow config section "
                               f"or MLflow's MLFLOW_TRACKING_URI)")
        self.logging_dir = Path(logging_dir or ".").absolute()
        #: the store: the mlflow section's, else MLflow's own (resolved in start), else sqlite in logging_dir
        self.tracking_uri: str | None = getattr(settings, "tracking_uri", None)
        self.experiment_name = (getattr(settings, "experiment_name", None)
                                or os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name))
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        tags = os.environ.get("MLFLOW_TAGS", tags)
        self.tags = json.loads(tags) if isinstance(tags, str) else dict(tags or {})
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.nested_run = nested.strip().lower() in TRUE if isinstance(nested, str) else bool(nested)
        self.run_name = run_name
        self.description = description
        self.client = None
        self.active_run = None

    @classmethod
    def check(cls, context: Any) -> list[str]:
        uri = context.config.mlflow.tracking_uri
        if uri is not None and uri.split(":", 1)[0].split("+", 1)[0] not in SCHEMES:
            return [f"mlflow.tracking_uri {uri!r} is not a store URI: use sqlite:///path/mlflow.db, "
                    f"file:///path/mlruns or http://host:port (or leave it unset: sqlite in the logging dir)"]
        return []

    def _store(self) -> str:
        """The tracking URI: the section's, else the one MLflow itself was given (``MLFLOW_TRACKING_URI`` or
        ``mlflow.set_tracking_uri``), else ``sqlite:///<logging_dir>/mlflow.db``."""
        import mlflow

        if self.tracking_uri:
            return self.tracking_uri
        if mlflow.is_tracking_uri_set():
            return str(mlflow.get_tracking_uri())
        return f"sqlite:///{self.logging_dir / 'mlflow.db'}"

    def start(self) -> None:
        from mlflow.tracking import MlflowClient

        default_store = not self.tracking_uri
        self.tracking_uri = self._store()
        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # chosen explicitly, in torchbay or MLflow
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment_name or "Default"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = None
            if default_store and self.tracking_uri == f"sqlite:///{self.logging_dir / 'mlflow.db'}":
                self.logging_dir.mkdir(parents=True, exist_ok=True)
                artifacts = (self.logging_dir / "artifacts").as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        self.experiment_name = name
        tags = {str(k): str(v) for k, v in self.tags.items()}
        if self.description:
            tags["mlflow.note.content"] = str(self.description)
        if self.run_id:  # resume that run, as mlflow.start_run(run_id=...) does
            self.client.update_run(self.run_id, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value)
            self.active_run = self.client.get_run(self.run_id)
            return
        parent = _active_run_id() if self.nested_run else None
        if parent:
            tags["mlflow.parentRunId"] = parent
        self.active_run = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = self.active_run.info.run_id

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

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """A matplotlib or plotly figure as the artifact ``artifact_file`` (Accelerate's method)."""
        self.client.log_figure(self.run_id, figure, artifact_file, save_kwargs=save_kwargs or None)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """A local file as an artifact, under ``artifact_path`` (Accelerate's method)."""
        self.client.log_artifact(self.run_id, local_path, artifact_path)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Every file of a local directory as artifacts, under ``artifact_path`` (Accelerate's method)."""
        self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def finish(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.client = None


def _active_run_id() -> str | None:
    """The run MLflow's fluent API has active in this process (the parent of a nested run), if any."""
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run is not None else None
