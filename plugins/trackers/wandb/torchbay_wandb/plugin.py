"""Registers the ``wandb`` tracker and its config section ``wandb:``.

- ``logging_dir``: wandb's ``dir`` (default ``<tracking logging dir>/wandb``); runs go to
  ``<logging_dir>/wandb/<offline-run-...|run-...>``.
- ``mode``: ``online``, ``offline`` (no network; ``wandb sync`` uploads later) or ``disabled``;
  unset: wandb's own default (``WANDB_MODE``, else online).
- ``entity``: the W&B team or user.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from torchbay.plugin import LazyClass, Section, hookimpl, library_version

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)

NAME = "wandb"


class WandbSection(Section):
    logging_dir: Optional[str] = Field(None, description="wandb's dir (default: <tracking logging dir>/wandb)")
    mode: Optional[Literal["online", "offline", "disabled", "shared"]] = Field(
        None, description="online, offline (sync later with wandb sync) or disabled; unset: WANDB_MODE, else online")
    entity: Optional[str] = Field(None, description="W&B team or user")


@hookimpl
def torchbay_register_trackers():
    return [LazyClass("torchbay_wandb.tracker:WandBTracker", name="wandb")]


@hookimpl
def torchbay_config_sections():
    return {NAME: WandbSection}


@hookimpl
def torchbay_report_env():
    return {"wandb": library_version("wandb")}
