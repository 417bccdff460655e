"""The ``mlu`` device: Cambricon MLUs through torch_mlu.

The runtime (``torch_mlu``) registers the ``mlu`` device type and the ``torch.mlu``
module with torch, after which torch's generic accelerator API does most of the work. The
runtime is imported only when the device is selected or probed (``load_runtime``), never
when this module is imported. This plugin adds the collective backend ``cncl``, the
visible-devices variable ``MLU_VISIBLE_DEVICES`` and the ``torchbay env`` line.

Config section ``mlu:``

- ``visible_devices``: device ids for ``MLU_VISIBLE_DEVICES``; unset: inherit the launcher's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pydantic import Field

from torchbay.config import Section
from torchbay.device import DeviceBackend
from torchbay.plugins import hookimpl

NAME = "mlu"


class MLUSection(Section):
    visible_devices: Optional[str] = Field(None, pattern=r"^\d+(,\d+)*$",
                                           description="device ids for MLU_VISIBLE_DEVICES; unset: inherit")


class MLUBackend(DeviceBackend):
    """Cambricon MLUs; one device per process (``local_rank`` modulo the count)."""

    name = NAME
    device_type = "mlu"
    priority = 93
    visible_devices_env = "MLU_VISIBLE_DEVICES"
    runtime_module = "torch_mlu"
    install_hint = "install torch_mlu for this torch from Cambricon (with the Neuware toolkit) on a machine with MLUs"
    compile_backend = "inductor"

    @classmethod
    def device_count(cls) -> int:
        if not cls.runtime_installed():
            return 0
        cls.load_runtime()
        return int(torch.get_device_module(cls.device_type).device_count())

    @classmethod
    def dist_backend(cls) -> str:
        return "cncl"

    def set_current(self) -> None:
        self.module.set_device(self.index)

    def report(self) -> dict[str, Any]:
        return {"device": str(self.device), "count": self.device_count(),
                "name": self.module.get_device_name(self.index)}


def _selected(config) -> bool:
    device = getattr(config, "device", "auto")
    if device == NAME:
        return True
    # auto: probe only when the runtime is there (the probe imports it)
    return device == "auto" and MLUBackend.runtime_installed() and MLUBackend.is_available()


@hookimpl
def torchbay_register_devices():
    return [MLUBackend]


@hookimpl
def torchbay_config_sections():
    return {NAME: MLUSection}


@hookimpl
def torchbay_launch_env(config, local_world_size: int):
    if not _selected(config):
        return None
    env = dict(MLUBackend.launch_env(local_world_size))
    section = getattr(config, NAME, None)
    if section is not None and section.visible_devices:
        env[MLUBackend.visible_devices_env] = section.visible_devices
    return env


@hookimpl
def torchbay_validate(context):
    if context.device_backend_cls is not MLUBackend:
        return None
    count, per_machine = MLUBackend.device_count(), context.cluster.local_world_size()
    if count and per_machine > count:
        return [f"device mlu: {per_machine} processes per machine but only {count} device(s) visible; "
                f"cncl needs one device per process: launch at most {count} per machine"]
    return None


@hookimpl
def torchbay_report_env():
    reason = MLUBackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}"}
    return {NAME: f"{MLUBackend.device_count()} device(s), collectives cncl"}
