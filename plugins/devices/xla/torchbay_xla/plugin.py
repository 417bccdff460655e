"""The ``xla`` device: TPUs (and XLA on GPU or CPU) through ``torch_xla`` with PJRT.

XLA differs most from torch's generic path; what this plugin overrides:

- detection without starting the XLA runtime (which would claim the TPU in the launcher):
  ``PJRT_DEVICE`` and the TPU chips under ``/dev`` are read, ``torch_xla`` is not imported;
- the device object (``torch_xla.device()``), RNG (an XLA seed, saved as an int64 tensor),
  memory (``xm.get_memory_info``), synchronize (``xm.wait_device_ops``);
- the step: ``optimizer_step`` goes through ``xm.optimizer_step`` (which also reduces
  gradients across XLA replicas when no torch.distributed group did so), and
  ``after_step`` marks the step (the graph is cut and run there);
- device-aware data loading (``MpDeviceLoader``, which overlaps host-to-device copies);
- rendezvous through XLA's runtime: the ``xla`` process-group backend with
  ``init_method="xla://"``, joined when the backend is set current in a multi-process job;
- ``PJRT_DEVICE`` for the workers and the ``openxla`` compile backend.

Config section ``xla:``

- ``pjrt_device``: ``TPU``, ``CUDA`` or ``CPU`` for ``PJRT_DEVICE``; unset: detected.
"""

from __future__ import annotations

import glob
import importlib
import os
from typing import Any, Literal, Optional

import torch
from pydantic import Field

from torchbay.plugin import DeviceBackend, Section, flops_key, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 3)  # 1.2: tpu_config reads Accelerate's config files; 1.3: peak_flops

NAME = "xla"


class XLASection(Section):
    pjrt_device: Optional[Literal["TPU", "CUDA", "CPU"]] = Field(
        None, description="PJRT_DEVICE for the workers; unset: TPU when TPU chips are found, else inherit")


def tpu_chip_count() -> int:
    """TPU chips on this host, from device files (no runtime started)."""
    accel = glob.glob("/dev/accel[0-9]*")  # TPU v2-v4
    vfio = [p for p in glob.glob("/dev/vfio/[0-9]*")]  # TPU v5 and later
    return len(accel) or len(vfio)


def pjrt_device() -> str | None:
    value = os.environ.get("PJRT_DEVICE")
    if value:
        return value.upper()
    return "TPU" if tpu_chip_count() else None


def _xm():
    return importlib.import_module("torch_xla.core.xla_model")


#: dense bf16 peak TFLOP/s per chip by the runtime's device kind, from Google Cloud's TPU pages
#: (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e: "Peak compute per chip (bf16)"): v4 275, v5e 197, v5p 459,
#: v6e (Trillium) 918. Other kinds and dtypes: unknown (no MFU).
TPU_BF16_PEAKS = {"TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v5p": 459.0,
                  "TPU v6 lite": 918.0, "TPU v6e": 918.0}


def tpu_peak_flops(device_kind: str, key: str | None) -> float | None:
    """FLOP/s of a TPU chip of ``device_kind`` (``"TPU v5 lite"``...) for the math ``key``, ``None`` when unknown."""
    figure = TPU_BF16_PEAKS.get(device_kind.strip())
    return figure * 1e12 if figure is not None and key == "bf16" else None


class XLABackend(DeviceBackend):
    """One XLA device per process (PJRT assigns TPU chips to processes)."""

    name = NAME
    device_type = "xla"
    accelerate_distributed_type = "XLA"  # Accelerate's name for a multi-process run here
    priority = 80
    runtime_module = "torch_xla"
    install_hint = ("pip install torchbay-xla[tpu] on a TPU VM (torch_xla of the same version as torch, with libtpu); "
                    "for XLA on GPU or CPU set PJRT_DEVICE=CUDA or CPU")

    def __init__(self, local_rank: int = 0):
        torch_xla = self.load_runtime()
        self.index = 0
        self.device = torch_xla.device() if hasattr(torch_xla, "device") else _xm().xla_device()

    # -- detection: never starts the runtime -----------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not cls.runtime_installed():
            return f"runtime 'torch_xla' is not installed: {cls.install_hint}"
        if pjrt_device() is None:
            return "no TPU found (no /dev/accel* or /dev/vfio chips) and PJRT_DEVICE is not set"
        return None

    @classmethod
    def device_count(cls) -> int:
        kind = pjrt_device() if cls.runtime_installed() else None
        if kind is None:
            return 0
        if kind == "TPU":
            return max(tpu_chip_count(), 1)
        return int(os.environ.get("GPU_NUM_DEVICES", "1")) if kind in ("CUDA", "GPU") else 1

    @classmethod
    def dist_backend(cls) -> str:
        return "xla"

    @classmethod
    def launch_env(cls, local_world_size: int, config: Any = None) -> dict[str, str]:
        section = getattr(config, NAME, None)
        if section is not None and section.pjrt_device:
            return {"PJRT_DEVICE": section.pjrt_device}
        kind = pjrt_device()
        return {"PJRT_DEVICE": kind} if kind and "PJRT_DEVICE" not in os.environ else {}

    @classmethod
    def supports_autocast(cls, dtype: torch.dtype) -> bool:
        if dtype == torch.float16:  # TPUs compute in bf16; fp16 only on XLA:GPU
            return pjrt_device() in ("CUDA", "GPU")
        return dtype == torch.bfloat16

    # -- per process -----------------------------------------------------------------------
    def set_current(self) -> None:
        """Join the process group through XLA's own rendezvous when there are several processes.

        The core's strategy then finds the group initialised and uses it.
        """
        import torch.distributed as dist

        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            importlib.import_module("torch_xla.distributed.xla_backend")  # registers "xla"
            dist.init_process_group("xla", init_method="xla://")

    def manual_seed(self, seed: int) -> None:
        _xm().set_rng_state(int(seed), device=self.device)

    def get_rng_state(self) -> list[torch.Tensor]:
        return [torch.tensor([int(_xm().get_rng_state(device=self.device))], dtype=torch.int64)]

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        _xm().set_rng_state(int(states[0].item()), device=self.device)

    def synchronize(self) -> None:
        _xm().wait_device_ops()

    def memory_stats(self) -> dict[str, int]:
        info = _xm().get_memory_info(self.device)
        if "bytes_limit" in info:
            used, total = int(info.get("bytes_used", 0)), int(info["bytes_limit"])
            peak = int(info.get("peak_bytes_used", used))
        else:  # older torch_xla: kb_free / kb_total
            total = int(info.get("kb_total", 0)) * 1024
            used = total - int(info.get("kb_free", 0)) * 1024
            peak = used
        return {"allocated": used, "peak_allocated": peak, "reserved": used, "free": max(total - used, 0),
                "total": total}

    def mem_get_info(self) -> tuple[int, int]:
        stats = self.memory_stats()
        return stats["free"], stats["total"]

    def reset_peak_memory(self) -> None:
        pass  # XLA keeps no resettable peak

    def empty_cache(self) -> None:
        pass

    def grad_scaler(self, **kwargs):
        return importlib.import_module("torch_xla.amp").GradScaler(**kwargs)

    def optimizer_step(self, optimizer, **kwargs):
        import torch.distributed as dist

        if dist.is_initialized():  # DDP over the xla backend already reduced the gradients
            return optimizer.step(**kwargs)
        return _xm().optimizer_step(optimizer, optimizer_args=kwargs)

    def after_step(self) -> None:
        torch_xla = importlib.import_module("torch_xla")
        sync = getattr(torch_xla, "sync", None)
        sync() if sync is not None else _xm().mark_step()

    def wrap_dataloader(self, dataloader):
        loader_module = importlib.import_module("torch_xla.distributed.parallel_loader")
        return loader_module.MpDeviceLoader(dataloader, self.device)

    def peak_flops(self, dtype: Any) -> float | None:
        """Google's published bf16 peak of this TPU chip (:data:`TPU_BF16_PEAKS`), else ``None``."""
        try:
            runtime = importlib.import_module("torch_xla.runtime")
            kind = str(runtime.global_runtime_device_attributes()[0].get("device_kind", ""))
        except Exception:  # an older runtime without device attributes: unknown, not guessed
            return None
        return tpu_peak_flops(kind, flops_key(dtype))

    def report(self) -> dict[str, Any]:
        return {"device": str(self.device), "count": self.device_count(), "pjrt_device": pjrt_device()}


@hookimpl
def torchbay_register_devices():
    return [XLABackend]


@hookimpl
def torchbay_config_sections():
    return {NAME: XLASection}


@hookimpl
def torchbay_report_env():
    reason = XLABackend.unavailable_reason()
    if reason:
        return {NAME: f"not available: {reason}"}
    return {NAME: f"PJRT_DEVICE={pjrt_device()}, {XLABackend.device_count()} device(s) (runtime not started)"}
