"""The ``cuda`` device: NVIDIA GPUs, and AMD GPUs through ROCm builds of torch (HIP).

torch's generic accelerator API already drives both; this plugin adds cheap detection
(NVML / AMD SMI counts, no CUDA context in the launcher), the visible-devices variable of
the build (``CUDA_VISIBLE_DEVICES`` or ``HIP_VISIBLE_DEVICES``), ``nccl`` (RCCL on ROCm),
bf16 capability and the ``torchbay env`` lines.

Which devices workers see is the core setting ``visible_devices``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torchbay.plugin import DeviceBackend, flops_key, hookimpl
from torchbay_cuda.peaks import peak_flops_of

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 3)

NAME = "cuda"
#: collectives each process group's flight recorder keeps (torch's ring buffer; a few hundred bytes each)
FLIGHT_RECORDER_ENTRIES = 2000


def _fr_named_generically() -> bool:
    """Whether this torch reads ``TORCH_FR_BUFFER_SIZE`` (it warns on the older ``TORCH_NCCL_TRACE_BUFFER_SIZE``)."""
    try:
        from torch._C import _distributed_c10d
    except ImportError:
        return False
    return hasattr(_distributed_c10d, "_dump_fr_trace")


class CUDABackend(DeviceBackend):
    """NVIDIA CUDA or AMD ROCm GPUs; one GPU per process (``local_rank`` modulo the count)."""

    name = NAME
    device_type = "cuda"
    accelerate_distributed_type = "MULTI_GPU"  # Accelerate's name for a multi-process run here
    priority = 100
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    install_hint = ("install a CUDA or ROCm build of torch (https://pytorch.org/get-started/locally/) on a machine "
                    "with an NVIDIA or AMD GPU and its driver")
    dist_backend_name = "nccl"

    @staticmethod
    def is_rocm() -> bool:
        return getattr(torch.version, "hip", None) is not None

    @classmethod
    def is_built(cls) -> bool:
        return bool(getattr(torch.version, "cuda", None) or cls.is_rocm())

    @classmethod
    def visible_devices_variable(cls) -> str:
        """The variable that selects GPUs for this build of torch."""
        return "HIP_VISIBLE_DEVICES" if cls.is_rocm() else cls.visible_devices_env

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not cls.is_built():
            return (f"no CUDA device: torch {torch.__version__} is built without CUDA or ROCm; {cls.install_hint}")
        if cls.device_count() == 0:
            mask = os.environ.get(cls.visible_devices_variable())
            where = f" ({cls.visible_devices_variable()}={mask!r})" if mask is not None else ""
            return f"no CUDA device: no {'ROCm' if cls.is_rocm() else 'NVIDIA'} GPU is visible{where}"
        return None

    @classmethod
    def device_count(cls) -> int:
        """GPUs visible to this process, counted without creating a CUDA context when possible."""
        if not cls.is_built():
            return 0
        if torch.cuda.is_initialized():
            return torch.cuda.device_count()
        probe = getattr(torch.cuda, "_device_count_amdsmi" if cls.is_rocm() else "_device_count_nvml", None)
        if probe is not None:
            try:
                count = probe()
                if count >= 0:
                    return count
            except Exception:
                pass
        return torch.cuda.device_count()

    @classmethod
    def compute_capability(cls, index: int = 0) -> tuple[int, int] | None:
        """Compute capability of CUDA device ``index``, or ``None`` when there is no NVIDIA GPU.

        NVML is tried first (it creates no CUDA context, so a launcher may call it before it
        forks workers); torch is the fallback.
        """
        if getattr(torch.version, "hip", None):
            return None
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))  # type: ignore[return-value]
            finally:
                pynvml.nvmlShutdown()
        except Exception:
            pass
        try:
            if torch.cuda.is_available():
                return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]
        except Exception:
            return None
        return None

    @classmethod
    def dist_backend(cls) -> str:
        return cls.dist_backend_name

    @classmethod
    def launch_env(cls, local_world_size: int, config: Any = None) -> dict[str, str]:
        """NCCL's flight recorder on: every process group keeps its last collectives, and on a collective timeout
        every rank dumps them (``torchbay launch`` points the dumps into its run directory and its failure report
        names the rank, collective and sequence number where the ranks diverged). A variable already set in the
        environment is left as it is."""
        buffer = "TORCH_FR_BUFFER_SIZE" if _fr_named_generically() else "TORCH_NCCL_TRACE_BUFFER_SIZE"
        wanted = {buffer: str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
        if "TORCH_NCCL_TRACE_BUFFER_SIZE" in os.environ or "TORCH_FR_BUFFER_SIZE" in os.environ:
            wanted.pop(buffer)
        return {key: value for key, value in wanted.items() if key not in os.environ}

    @classmethod
    def supports_autocast(cls, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16 and torch.cuda.is_initialized():  # asking earlier would create a context
            return torch.cuda.is_bf16_supported(including_emulation=False)
        return super().supports_autocast(dtype)

    def peak_flops(self, dtype: Any) -> float | None:
        """The published dense peak of this GPU for ``dtype`` (torchbay_cuda.peaks, with its sources), by the
        device's name; ``None`` for a GPU the table does not identify exactly."""
        return peak_flops_of(torch.cuda.get_device_name(self.index), flops_key(dtype))

    def record_memory_history(self, max_entries: int) -> bool:
        """torch's CUDA allocator history (``torch.cuda.memory._record_memory_history``), for the snapshot."""
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
        return True

    def dump_memory_snapshot(self, path: str) -> bool:
        torch.cuda.memory._dump_snapshot(path)
        return True

    def report(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.index)
        return {"device": str(self.device), "count": self.device_count(), "name": props.name,
                "memory_bytes": props.total_memory}


def describe_devices() -> str:
    """One line for ``torchbay env``: the GPUs found, or why none can be used."""
    reason = CUDABackend.unavailable_reason()
    if reason:
        return f"not available: {reason}"
    count = CUDABackend.device_count()
    runtime = f"ROCm {torch.version.hip}" if CUDABackend.is_rocm() else f"CUDA {torch.version.cuda}"
    try:
        names = []
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            names.append(f"{props.name} ({props.total_memory / 2**30:.1f} GiB)")
        detail = ", ".join(names)
    except Exception as exc:  # a driver problem must not break `torchbay env`
        detail = f"properties unavailable: {type(exc).__name__}: {exc}"
    return f"{count} device(s), {runtime}: {detail}"


@hookimpl
def torchbay_register_devices():
    return [CUDABackend]


@hookimpl
def torchbay_report_env():
    return {NAME: describe_devices()}
