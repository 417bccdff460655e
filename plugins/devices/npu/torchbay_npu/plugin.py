"""The ``npu`` device: Huawei Ascend NPUs through torch_npu.

The runtime (``torch_npu``) registers the ``npu`` device type and the ``torch.npu``
module with torch, after which torch's generic accelerator API does most of the work. The
runtime is imported only when the device is selected or probed (``load_runtime``), never
when this module is imported. This plugin adds the collective backend ``hccl``, the
visible-devices variable ``ASCEND_RT_VISIBLE_DEVICES`` and the ``torchbay env`` line.

Which devices workers see is the core setting ``visible_devices``.
"""

from __future__ import annotations

from torchbay.plugin import DeviceBackend, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 0)

NAME = "npu"


class NPUBackend(DeviceBackend):
    """Ascend NPUs; one device per process (``local_rank`` modulo the count)."""

    name = NAME
    device_type = "npu"
    priority = 95
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    runtime_module = "torch_npu"
    install_hint = ("pip install torchbay-npu[runtime] (torch_npu of the same version as torch) on a machine with "
                    "Ascend NPUs and the CANN toolkit")
    collective_backend = "hccl"


@hookimpl
def torchbay_register_devices():
    return [NPUBackend]


@hookimpl
def torchbay_report_env():
    reason = NPUBackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}"}
    return {NAME: f"{NPUBackend.device_count()} device(s), collectives hccl"}
