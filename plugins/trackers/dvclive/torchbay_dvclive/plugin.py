"""Registers the ``dvclive`` tracker and its config section ``dvclive:``.

- ``logging_dir``: default ``<tracking logging dir>/dvclive``; each run writes
  ``<logging_dir>/<project_name>/`` (``params.yaml``, ``metrics.json``, ``plots/metrics/*.tsv``).
- ``save_dvc_exp``: also save a DVC experiment at the end (needs a Git + DVC repository).
- ``dvc_init``: let DVCLive run ``dvc init`` in the Git repository around the working directory
  when that repository has no DVC set-up (what every ``dvclive.Live()`` does); without it (or
  ``save_dvc_exp``) such a run is refused before it starts, saying so.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from torchbay.plugin import LazyClass, Section, hookimpl, library_version

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)

NAME = "dvclive"


class DVCLiveSection(Section):
    logging_dir: Optional[str] = Field(None, description="default: <tracking logging dir>/dvclive")
    save_dvc_exp: bool = Field(False, description="save a DVC experiment at end_training (needs Git and DVC)")
    dvc_init: bool = Field(False, description="let DVCLive run `dvc init` (.dvc/ and .dvcignore, staged in Git) in "
                                              "the Git repository around the working directory when it has no DVC "
                                              "set-up, as every dvclive.Live() does")


@hookimpl
def torchbay_register_trackers():
    return [LazyClass("torchbay_dvclive.tracker:DVCLiveTracker", name="dvclive")]


@hookimpl
def torchbay_config_sections():
    return {NAME: DVCLiveSection}


@hookimpl
def torchbay_report_env():
    return {"dvclive": library_version("dvclive")}
