"""The ``mps`` device: Apple silicon GPUs through Metal Performance Shaders.

MPS runs one process (there is no collective backend for MPS tensors), so this device
declares ``multi_process = False``, so the core rejects multi-process jobs. Its
RNG, memory and synchronize calls are ``torch.mps``'s own (it has no per-device
``*_all`` variants); autocast dtypes are declared only where torch and macOS support them.

Config section ``mps:``

- ``cpu_fallback``: run ops MPS lacks on the CPU (``PYTORCH_ENABLE_MPS_FALLBACK=1``).
"""

from __future__ import annotations

import platform
from typing import Any

import torch
from pydantic import Field

from torchbay.plugin import DeviceBackend, Section, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 0)

NAME = "mps"


class MPSSection(Section):
    cpu_fallback: bool = Field(False,
                               description="run ops MPS does not implement on the CPU (PYTORCH_ENABLE_MPS_FALLBACK)")


class MPSBackend(DeviceBackend):
    """The Apple GPU of this Mac; single process."""

    name = NAME
    device_type = "mps"
    priority = 50
    multi_process = False
    shares_host_memory = True  # Apple silicon's unified memory
    install_hint = "MPS needs macOS 12.3 or later on Apple silicon with torch's macOS arm64 wheels"

    def __init__(self, local_rank: int = 0):
        self.index = 0
        self.device = torch.device("mps")
        self._peak = 0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.backends.mps.is_built():
            return (f"torch {torch.__version__} is built without MPS (this is {platform.system()} "
                    f"{platform.machine()}); {cls.install_hint}")
        if not torch.backends.mps.is_available():
            return f"no MPS device: {cls.install_hint}"
        return None

    @classmethod
    def device_count(cls) -> int:
        return 1 if torch.backends.mps.is_built() and torch.backends.mps.is_available() else 0

    @classmethod
    def dist_backend(cls) -> str:
        return "gloo"

    @classmethod
    def supports_autocast(cls, dtype: torch.dtype) -> bool:
        if not torch.amp.is_autocast_available("mps"):
            return False
        if dtype == torch.bfloat16:  # bf16 on MPS needs macOS 14
            return torch.backends.mps.is_built() and torch.backends.mps.is_macos_or_newer(14, 0)
        return dtype == torch.float16

    def set_current(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def get_rng_state(self) -> list[torch.Tensor]:
        return [torch.mps.get_rng_state()]

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        torch.mps.set_rng_state(states[0])

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def memory_stats(self) -> dict[str, int]:
        allocated = int(torch.mps.current_allocated_memory())
        driver = int(torch.mps.driver_allocated_memory())
        total = int(torch.mps.recommended_max_memory())
        self._peak = max(self._peak, allocated)  # torch.mps keeps no peak; track what was seen
        return {"allocated": allocated, "peak_allocated": self._peak, "reserved": driver,
                "free": max(total - driver, 0), "total": total}

    def mem_get_info(self) -> tuple[int, int]:
        stats = self.memory_stats()
        return stats["free"], stats["total"]

    def reset_peak_memory(self) -> None:
        self._peak = 0

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    @classmethod
    def launch_env(cls, local_world_size: int, config: Any = None) -> dict[str, str]:
        section = getattr(config, NAME, None)
        return {"PYTORCH_ENABLE_MPS_FALLBACK": "1"} if section is not None and section.cpu_fallback else {}

    def report(self) -> dict[str, Any]:
        return {"device": "mps", "count": 1, "macos": platform.mac_ver()[0]}


@hookimpl
def torchbay_register_devices():
    return [MPSBackend]


@hookimpl
def torchbay_config_sections():
    return {NAME: MPSSection}


@hookimpl
def torchbay_report_env():
    reason = MPSBackend.unavailable_reason()
    return {NAME: f"not available: {reason}" if reason else f"1 device (macOS {platform.mac_ver()[0]})"}
