"""Registers the ``trackio`` tracker and its config section ``trackio:``.

- ``logging_dir``: Trackio's local store (``TRACKIO_DIR``; one ``<project>.db`` per project);
  default ``<tracking logging dir>/trackio``.
- ``space_id`` / ``server_url``: log to a Hugging Face Space or a Trackio server instead.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from torchbay.plugin import LazyClass, Section, hookimpl, library_version

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)

NAME = "trackio"


class TrackioSection(Section):
    logging_dir: Optional[str] = Field(None, description="Trackio's local store, TRACKIO_DIR (default: <tracking "
                                                         "logging dir>/trackio)")
    space_id: Optional[str] = Field(None, description="log to this Hugging Face Space instead (user/space)")
    server_url: Optional[str] = Field(None, pattern=r"^https?://", description="log to this Trackio server instead")


@hookimpl
def torchbay_register_trackers():
    return [LazyClass("torchbay_trackio.tracker:TrackioTracker", name="trackio")]


@hookimpl
def torchbay_config_sections():
    return {NAME: TrackioSection}


@hookimpl
def torchbay_report_env():
    return {"trackio": library_version("trackio")}
