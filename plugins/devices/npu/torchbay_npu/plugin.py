"""The ``npu`` device: Huawei Ascend NPUs through torch_npu.

The runtime (``torch_npu``) registers the ``npu`` device type and the ``torch.npu``
module with torch, after which torch's generic accelerator API does most of the work. The
runtime is imported only when the device is selected or probed (``load_runtime``), never
when this module is imported. This plugin adds the collective backend ``hccl``, the
visible-devices variable ``ASCEND_RT_VISIBLE_DEVICES`` and the ``torchbay env`` line.

Config section ``npu:``

- ``visible_devices``: device ids for ``ASCEND_RT_VISIBLE_DEVICES``; unset: inherit the launcher's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pydantic import Field

from torchbay.config import Section
from torchbay.device import DeviceBackend
from torchbay.plugins import hookimpl

NAME = "npu"


class NPUSection(Section):
    visible_devices: Optional[str] = Field(None, pattern=r"^\d+(,\d+)*$",
                                           description="device ids for ASCEND_RT_VISIBLE_DEVICES; unset: inherit")


class NPUBackend(DeviceBackend):
    """Ascend NPUs; one device per process (``local_rank`` modulo the count)."""

    name = NAME
    device_type = "npu"
    priority = 95
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    runtime_module = "torch_npu"
    install_hint = "pip install torchbay-npu[runtime] (torch_npu of the same version as torch) on a machine with Ascend NPUs and the CANN toolkit"
    compile_backend = "inductor"

    @classmethod
    def device_count(cls) -> int:
        if not cls.runtime_installed():
            return 0
        cls.load_runtime()
        return int(torch.get_device_module(cls.device_type).device_count())

    @classmethod
    def dist_backend(cls) -> str:
        return "hccl"

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
    return device == "auto" and NPUBackend.runtime_installed() and NPUBackend.is_available()


@hookimpl
def torchbay_register_devices():
    return [NPUBackend]


@hookimpl
def torchbay_config_sections():
    return {NAME: NPUSection}


@hookimpl
def torchbay_launch_env(config, local_world_size: int):
    if not _selected(config):
        return None
    env = dict(NPUBackend.launch_env(local_world_size))
    section = getattr(config, NAME, None)
    if section is not None and section.visible_devices:
        env[NPUBackend.visible_devices_env] = section.visible_devices
    return env


@hookimpl
def torchbay_validate(context):
    if context.device_backend_cls is not NPUBackend:
        return None
    count, per_machine = NPUBackend.device_count(), context.cluster.local_world_size()
    if count and per_machine > count:
        return [f"device npu: {per_machine} processes per machine but only {count} device(s) visible; "
                f"hccl needs one device per process: launch at most {count} per machine"]
    return None


@hookimpl
def torchbay_report_env():
    reason = NPUBackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}"}
    return {NAME: f"{NPUBackend.device_count()} device(s), collectives hccl"}
