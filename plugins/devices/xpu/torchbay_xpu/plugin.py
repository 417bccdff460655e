"""The ``xpu`` device: Intel GPUs through torch's native XPU support.

torch's generic accelerator API drives XPU (RNG, memory, synchronize, autocast); this
plugin adds detection, ``ZE_AFFINITY_MASK`` for the workers, the collective backend
(``xccl`` when torch has it, else oneCCL's ``ccl``), and intel-extension-for-pytorch: when
a version matching torch's major.minor is installed it is imported with the device (its
kernels and optimizations register themselves); a mismatched one is left alone and
reported.

Which devices workers see is the core setting ``visible_devices``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

import torch

from torchbay.plugin import DeviceBackend, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 0)

NAME = "xpu"
IPEX = "intel_extension_for_pytorch"


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def ipex_status() -> tuple[bool, str]:
    """(usable, description) of intel-extension-for-pytorch, read from metadata (no import)."""
    if importlib.util.find_spec(IPEX) is None:
        return False, "intel-extension-for-pytorch not installed"
    try:
        version = importlib.metadata.version("intel-extension-for-pytorch")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if _major_minor(version) != _major_minor(torch.__version__):
        return False, (f"intel-extension-for-pytorch {version} does not match torch {torch.__version__} "
                       f"(needs {'.'.join(_major_minor(torch.__version__))}.x): not used")
    return True, f"intel-extension-for-pytorch {version}"


class XPUBackend(DeviceBackend):
    """Intel GPUs (``torch.xpu``); one device per process."""

    name = NAME
    device_type = "xpu"
    priority = 92
    visible_devices_env = "ZE_AFFINITY_MASK"
    install_hint = ("install torch's XPU build (pip install torch --index-url https://download.pytorch.org/whl/xpu) "
                    "and the Intel GPU driver")
    ipex_loaded: bool = False

    @classmethod
    def load_runtime(cls) -> Any:
        usable, _ = ipex_status()
        if usable and not cls.ipex_loaded:
            module = importlib.import_module(IPEX)
            cls.ipex_loaded = True
            return module
        if cls.dist_backend() == "ccl" and importlib.util.find_spec("oneccl_bindings_for_pytorch"):
            importlib.import_module("oneccl_bindings_for_pytorch")  # registers the "ccl" backend
        return None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        compiled = getattr(torch.xpu, "_is_compiled", lambda: False)()
        if not compiled:
            return f"torch {torch.__version__} is built without XPU support; {cls.install_hint}"
        if cls.device_count() == 0:
            return "no Intel GPU found (torch.xpu.device_count() is 0; check the driver and ZE_AFFINITY_MASK)"
        return None

    @classmethod
    def device_count(cls) -> int:
        if not getattr(torch.xpu, "_is_compiled", lambda: False)():
            return 0
        return torch.xpu.device_count()

    @classmethod
    def dist_backend(cls) -> str:
        import torch.distributed as dist

        return "xccl" if getattr(dist, "is_xccl_available", lambda: False)() else "ccl"

    def report(self) -> dict[str, Any]:
        return {"device": str(self.device), "count": self.device_count(), "name": torch.xpu.get_device_name(self.index),
                "ipex": ipex_status()[1]}


@hookimpl
def torchbay_register_devices():
    return [XPUBackend]


@hookimpl
def torchbay_report_env():
    reason = XPUBackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}", "xpu ipex": ipex_status()[1]}
    return {NAME: f"{XPUBackend.device_count()} device(s), collectives {XPUBackend.dist_backend()}",
            "xpu ipex": ipex_status()[1]}
