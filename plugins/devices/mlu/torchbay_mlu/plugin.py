"""The ``mlu`` device: Cambricon MLUs through torch_mlu.

The runtime (``torch_mlu``) registers the ``mlu`` device type and the ``torch.mlu``
module with torch, after which torch's generic accelerator API does most of the work. The
runtime is imported only when the device is selected or probed (``load_runtime``), never
when this module is imported. This plugin adds the collective backend ``cncl``, the
visible-devices variable ``MLU_VISIBLE_DEVICES`` and the ``torchbay env`` line.

Which devices workers see is the core setting ``visible_devices``.
"""

from __future__ import annotations

from typing import Any

import torch

from torchbay.device import DeviceBackend
from torchbay.plugins import hookimpl

NAME = "mlu"


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


@hookimpl
def torchbay_register_devices():
    return [MLUBackend]


@hookimpl
def torchbay_report_env():
    reason = MLUBackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}"}
    return {NAME: f"{MLUBackend.device_count()} device(s), collectives cncl"}
