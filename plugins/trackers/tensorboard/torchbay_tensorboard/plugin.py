"""Registers the ``tensorboard`` tracker and its config section ``tensorboard:``.

- ``logging_dir``: where the event files go (default ``<tracking logging dir>/tensorboard``);
  each run writes into ``<logging_dir>/<project_name>``.
- ``flush_secs``, ``max_queue``: how often the writer flushes (``SummaryWriter``'s arguments).
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from torchbay.plugin import LazyClass, Section, hookimpl, library_version

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)

NAME = "tensorboard"


class TensorBoardSection(Section):
    logging_dir: Optional[str] = Field(None, description="directory of the event files (default: <tracking "
                                                         "logging dir>/tensorboard)")
    flush_secs: int = Field(120, ge=1, description="seconds between flushes of the event file")
    max_queue: int = Field(10, ge=1, description="events queued before a flush")


@hookimpl
def torchbay_register_trackers():
    return [LazyClass("torchbay_tensorboard.tracker:TensorBoardTracker", name="tensorboard")]


@hookimpl
def torchbay_config_sections():
    return {NAME: TensorBoardSection}


@hookimpl
def torchbay_report_env():
    return {"tensorboard": library_version("tensorboard")}
