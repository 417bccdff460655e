"""Registers the ``aim`` tracker and its config section ``aim:``.

- ``logging_dir``: the Aim repository (``<logging_dir>/.aim``); default
  ``<tracking logging dir>/aim``.
- ``system_tracking_interval``: seconds between system-usage samples (unset: none).
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from torchbay.plugin import LazyClass, Section, hookimpl, library_version

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)

NAME = "aim"


class AimSection(Section):
    logging_dir: Optional[str] = Field(None, description="the Aim repository (default: <tracking logging dir>/aim)")
    system_tracking_interval: Optional[float] = Field(None, gt=0, description="seconds between system-usage "
                                                                              "samples; unset: none")


@hookimpl
def torchbay_register_trackers():
    return [LazyClass("torchbay_aim.tracker:AimTracker", name="aim")]


@hookimpl
def torchbay_config_sections():
    return {NAME: AimSection}


@hookimpl
def torchbay_report_env():
    return {"aim": library_version("aim")}
