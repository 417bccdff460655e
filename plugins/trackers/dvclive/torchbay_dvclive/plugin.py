"""Registers the ``dvclive`` tracker and its config section ``dvclive:``.

- ``logging_dir``: default ``<tracking logging dir>/dvclive``; each run writes
  ``<logging_dir>/<project_name>/`` (``params.yaml``, ``metrics.json``, ``plots/metrics/*.tsv``).
- ``save_dvc_exp``: also save a DVC experiment at the end (needs a Git + DVC repository).
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from torchbay.config import Section
from torchbay.plugins import hookimpl

NAME = "dvclive"


class DVCLiveSection(Section):
    logging_dir: Optional[str] = Field(None, description="default: <tracking logging dir>/dvclive")
    save_dvc_exp: bool = Field(False, description="save a DVC experiment at end_training (needs Git and DVC)")


@hookimpl
def torchbay_register_trackers():
    from torchbay_dvclive.tracker import DVCLiveTracker

    return [DVCLiveTracker]


@hookimpl
def torchbay_config_sections():
    return {NAME: DVCLiveSection}


@hookimpl
def torchbay_report_env():
    from torchbay.plugins import library_version

    return {"dvclive": library_version("dvclive")}
