"""The ``hpu`` device: Intel Gaudi accelerators through ``habana_frameworks.torch``.

HPU differs from torch's generic accelerator path in a few places, and only those are
overridden here:

- lazy mode (``PT_HPU_LAZY_MODE=1``): ops are collected into graphs that run at
  ``mark_step``; torchbay marks a step before the optimizer step (ends the backward graph)
  and after it (ends the update graph). In eager / ``torch.compile`` mode nothing is marked.
- RNG through ``habana_frameworks.torch.hpu.random`` (one card per process), so that
  ``save_state`` / ``load_state`` save *and* restore it;
- memory from the runtime's ``memory_stats`` (``InUse``, ``MaxInUse``, ``Limit``);
- ``hccl`` collectives (``habana_frameworks.torch.distributed.hccl`` registers them),
  ``HABANA_VISIBLE_MODULES`` for the workers, and the ``hpu_backend`` compile backend.

Which modules workers see is the core setting ``visible_devices`` (``HABANA_VISIBLE_MODULES``).

Config section ``hpu:``

- ``lazy_mode``: ``true`` / ``false`` sets ``PT_HPU_LAZY_MODE`` for the workers; unset: inherit.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

import torch
from pydantic import Field

from torchbay.plugin import DeviceBackend, Section, flops_key, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 3)  # 1.3: peak_flops

NAME = "hpu"


class HPUSection(Section):
    lazy_mode: Optional[bool] = Field(None, description="PT_HPU_LAZY_MODE for the workers; unset: inherit")


def _hpu():
    """``habana_frameworks.torch.hpu`` (imported on first use)."""
    return importlib.import_module("habana_frameworks.torch.hpu")


#: dense peak TFLOP/s of the Gaudi generations Intel publishes a figure for, by ``get_device_name``: Gaudi 3,
#: Intel Gaudi 3 AI Accelerator white paper (2024): MME BF16 and FP8 1835 TFLOP/s. Gaudi and Gaudi 2 have no entry
#: here until their figures are checked against Intel's datasheet: their MFU is absent, never guessed.
GAUDI_PEAKS = {"GAUDI3": {"bf16": 1835.0, "fp8": 1835.0}}


def gaudi_peak_flops(device_name: str, key: str | None) -> float | None:
    """FLOP/s of a Gaudi device called ``device_name`` for the math ``key``, ``None`` when unknown."""
    figures = GAUDI_PEAKS.get(device_name.strip().upper().replace(" ", ""), {})
    return figures[key] * 1e12 if key in figures else None


class HPUBackend(DeviceBackend):
    """Intel Gaudi; one card per process."""

    name = NAME
    device_type = "hpu"
    priority = 94
    visible_devices_env = "HABANA_VISIBLE_MODULES"
    runtime_module = "habana_frameworks.torch"
    install_hint = ("install the Intel Gaudi software stack (habana_frameworks.torch, from Intel's Gaudi installer; "
                    "it is not on PyPI) on a machine with Gaudi cards")

    def __init__(self, local_rank: int = 0):
        super().__init__(local_rank)
        self.lazy = self.lazy_mode()
        self._core = importlib.import_module("habana_frameworks.torch.core") if self.lazy else None

    @classmethod
    def load_runtime(cls) -> Any:
        module = importlib.import_module("habana_frameworks.torch.core")  # registers the hpu device with torch
        return module

    @staticmethod
    def lazy_mode() -> bool:
        """Whether graphs are built lazily (then steps must be marked)."""
        value = os.environ.get("PT_HPU_LAZY_MODE")
        if value is not None:
            return value.strip() not in ("0", "false", "False")
        try:  # the runtime knows its own default
            return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
        except Exception:
            return False

    @classmethod
    def device_count(cls) -> int:
        if not cls.runtime_installed():
            return 0
        cls.load_runtime()
        return int(_hpu().device_count())

    @classmethod
    def dist_backend(cls) -> str:
        return "hccl"

    def set_current(self) -> None:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")  # registers the hccl backend

    # -- RNG: the runtime's own generator --------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        _hpu().random.manual_seed(seed)

    def get_rng_state(self) -> list[torch.Tensor]:
        return [_hpu().random.get_rng_state().cpu()]

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        _hpu().random.set_rng_state(states[0])

    # -- lazy-mode deltas --------------------------------------------------------------------
    def mark_step(self) -> None:
        if self._core is not None:
            self._core.mark_step()

    def optimizer_step(self, optimizer, **kwargs):
        self.mark_step()  # ends the backward graph before the update reads the gradients
        return optimizer.step(**kwargs)

    def after_step(self) -> None:
        self.mark_step()

    # -- memory ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        _hpu().synchronize()

    def memory_stats(self) -> dict[str, int]:
        stats = _hpu().memory_stats(self.index)
        in_use, limit = int(stats.get("InUse", 0)), int(stats.get("Limit", 0))
        return {"allocated": in_use, "peak_allocated": int(stats.get("MaxInUse", in_use)), "reserved": in_use,
                "free": max(limit - in_use, 0), "total": limit}

    def mem_get_info(self) -> tuple[int, int]:
        stats = self.memory_stats()
        return stats["free"], stats["total"]

    def reset_peak_memory(self) -> None:
        _hpu().reset_peak_memory_stats(self.index)

    def empty_cache(self) -> None:
        pass  # the Gaudi allocator keeps its pool; there is nothing to release

    @classmethod
    def launch_env(cls, local_world_size: int, config: Any = None) -> dict[str, str]:
        section = getattr(config, NAME, None)
        if section is not None and section.lazy_mode is not None:
            return {"PT_HPU_LAZY_MODE": "1" if section.lazy_mode else "0"}
        return {}

    def peak_flops(self, dtype: Any) -> float | None:
        """Intel's published dense peak of this Gaudi for ``dtype`` (:data:`GAUDI_PEAKS`), else ``None``."""
        return gaudi_peak_flops(str(_hpu().get_device_name(self.index)), flops_key(dtype))

    def report(self) -> dict[str, Any]:
        return {"device": str(self.device), "count": self.device_count(), "name": _hpu().get_device_name(self.index),
                "lazy_mode": self.lazy}


@hookimpl
def torchbay_register_devices():
    return [HPUBackend]


@hookimpl
def torchbay_config_sections():
    return {NAME: HPUSection}


@hookimpl
def torchbay_report_env():
    reason = HPUBackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}"}
    return {NAME: f"{HPUBackend.device_count()} card(s), collectives hccl, "
                  f"{'lazy' if HPUBackend.lazy_mode() else 'eager'} mode"}
