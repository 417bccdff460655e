"""The ``mlu`` device: Cambricon MLUs through torch_mlu.

The runtime (``torch_mlu``) registers the ``mlu`` device type and the ``torch.mlu``
module with torch, after which torch's generic accelerator API does most of the work. The
runtime is imported only when the device is selected or probed (``load_runtime``), never
when this module is imported. This plugin adds the collective backend ``cncl``, the
visible-devices variable ``MLU_VISIBLE_DEVICES`` and the ``torchbay env`` line.

Which devices workers see is the core setting ``visible_devices``.
"""

from __future__ import annotations

from torchbay.plugin import DeviceBackend, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 0)

NAME = "mlu"


class MLUBackend(DeviceBackend):
    """Cambricon MLUs; one device per process (``local_rank`` modulo the count)."""

    name = NAME
    device_type = "mlu"
    priority = 93
    visible_devices_env = "MLU_VISIBLE_DEVICES"
    runtime_module = "torch_mlu"
    install_hint = "install torch_mlu for this torch from Cambricon (with the Neuware toolkit) on a machine with MLUs"
    collective_backend = "cncl"


@hookimpl
def torchbay_register_devices():
    return [MLUBackend]


@hookimpl
def torchbay_report_env():
    reason = MLUBackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}"}
    return {NAME: f"{MLUBackend.device_count()} device(s), collectives cncl"}
