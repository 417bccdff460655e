"""Registers the ``mlflow`` tracker and its config section ``mlflow:``.

- ``logging_dir``: where the default store lives (default ``<tracking logging dir>/mlflow``:
  ``mlflow.db`` and ``artifacts/``).
- ``tracking_uri``: another store or a tracking server (``sqlite:///path/mlflow.db``,
  ``file:///path/mlruns``, ``http://host:5000``); default: the sqlite store in ``logging_dir``.
- ``experiment_name``: default the run name given to ``init_trackers``.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from torchbay.plugin import LazyClass, Section, hookimpl, library_version

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)

NAME = "mlflow"


class MLflowSection(Section):
    logging_dir: Optional[str] = Field(None, description="directory of the default sqlite store and artifacts "
                                                         "(default: <tracking logging dir>/mlflow)")
    tracking_uri: Optional[str] = Field(None, description="store or server URI (sqlite:///..., file:///..., "
                                                          "http://...); default: sqlite in logging_dir")
    experiment_name: Optional[str] = Field(None, description="MLflow experiment (default: init_trackers' name)")


@hookimpl
def torchbay_register_trackers():
    return [LazyClass("torchbay_mlflow.tracker:MLflowTracker", name="mlflow")]


@hookimpl
def torchbay_config_sections():
    return {NAME: MLflowSection}


@hookimpl
def torchbay_report_env():
    return {"mlflow": library_version("mlflow")}
