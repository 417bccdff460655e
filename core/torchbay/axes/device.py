"""The device axis: where tensors live, RNG, memory, collective backend, launch env.

:class:`DeviceBackend` is generic: built on torch's device-generic APIs
(``torch.accelerator``, ``torch.get_device_module``, ``torch.amp``,
``torch.distributed.get_default_backend_for_device``), it already works for any device
torch knows as its current accelerator. A device plugin subclasses it, sets ``name`` (and
``device_type`` when the torch type differs), and overrides only what its device does
differently.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch

#: the keys of :meth:`DeviceBackend.peak_flops`'s figures: the math a device publishes a peak for
FLOPS_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")


def flops_key(dtype: Any) -> str | None:
    """``torch.bfloat16`` or ``"bf16"`` -> ``"bf16"``; every float8 dtype -> ``"fp8"``, float4 -> ``"fp4"``; a
    dtype with no peak of its own (integers, float64) -> ``None``."""
    if isinstance(dtype, str):
        key = dtype.lower().replace("float", "fp").replace("bfp16", "bf16")
        aliases = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "half": "fp16", "fp8": "fp8",
                   "fp4": "fp4", "no": "fp32"}
        return aliases.get(key)
    if not isinstance(dtype, torch.dtype):
        return None
    if dtype == torch.float32:
        return "fp32"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    name = str(dtype)
    if "float8" in name:
        return "fp8"
    if "float4" in name:
        return "fp4"
    return None


class DeviceBackend:
    """One kind of device. Instantiated once per process for the device it uses.

    Class attributes a plugin sets:

    - ``name``: the value of ``config.device`` that selects it;
    - ``device_type``: torch's device type string (defaults to ``name``);
    - ``priority``: order for ``device: auto`` (higher first; cpu is 0);
    - ``visible_devices_env``: e.g. ``"CUDA_VISIBLE_DEVICES"``, or ``None``;
    - ``runtime_module``: module to import when selected (``"torch_npu"``), or ``None``;
    - ``install_hint``: what to install when the runtime is missing.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    priority: ClassVar[int] = 10
    visible_devices_env: ClassVar[str | None] = None
    runtime_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""
    #: the process-group backend (hccl, cncl...); ``None``: torch's default for the device type
    collective_backend: ClassVar[str | None] = None
    supports_fp16_autocast: ClassVar[bool] = True
    supports_bf16_autocast: ClassVar[bool] = True
    #: False for devices that run one process per machine at most
    multi_process: ClassVar[bool] = True
    #: whether each process needs a device of its own (collective libraries bind one per process)
    one_process_per_device: ClassVar[bool] = True
    #: Accelerate's DistributedType member for a multi-process ddp run here (None: MULTI_<NAME>)
    accelerate_distributed_type: ClassVar[str | None] = None
    #: share of each device's total memory that big-model placement (``device_map="auto"``)
    #: leaves free for activations, the allocator's cache and the runtime
    placement_headroom: ClassVar[float] = 0.10
    #: whether host memory can be page-locked for this device: an asynchronous save's staging
    #: copy is then pinned (faster, non-blocking copies from the device)
    pinned_staging: ClassVar[bool] = True
    #: whether the device's memory is the host's (unified memory): big-model placement then keeps
    #: room for the largest offloaded layer on the device alone, not on the cpu as well
    shares_host_memory: ClassVar[bool] = False

    def __init__(self, local_rank: int = 0):
        self.load_runtime()
        count = max(self.device_count(), 1)
        self.index = local_rank % count
        self.device = torch.device(self.torch_type(), self.index)

    # -- detection (class level, cheap, never initialises the device) -------------------
    @classmethod
    def torch_type(cls) -> str:
        return cls.device_type or cls.name

    @classmethod
    def load_runtime(cls) -> Any:
        """Import the vendor runtime (it registers the device with torch), if any."""
        if cls.runtime_module:
            return importlib.import_module(cls.runtime_module)
        return None

    @classmethod
    def runtime_installed(cls) -> bool:
        if not cls.runtime_module:
            return True
        return importlib.util.find_spec(cls.runtime_module.split(".")[0]) is not None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` when usable here, else why not and what to do about it."""
        if not cls.runtime_installed():
            return f"runtime '{cls.runtime_module}' is not installed" + (
                f": {cls.install_hint}" if cls.install_hint else "")
        try:
            cls.load_runtime()
        except Exception as exc:  # a broken vendor runtime must not break detection
            return f"importing '{cls.runtime_module}' failed: {type(exc).__name__}: {exc}"
        if cls.device_count() == 0:
            return f"no {cls.name} device found on this machine"
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    @classmethod
    def device_count(cls) -> int:
        if cls.runtime_module:  # a vendor runtime registers its device module with torch when imported
            if not cls.runtime_installed():
                return 0
            cls.load_runtime()
            module = getattr(torch, cls.torch_type(), None)
            if module is not None and hasattr(module, "device_count"):
                return int(module.device_count())
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None or accelerator.type != cls.torch_type():
            return 0
        return torch.accelerator.device_count()

    @classmethod
    def compute_capability(cls, index: int = 0) -> tuple[int, int] | None:
        """The device's compute capability (major, minor) where the vendor has one, else ``None``.

        Must not initialise the device (a launcher may ask before it starts workers).
        """
        return None

    @classmethod
    def check(cls, context: Any) -> list[str]:
        """Problems with running on this device in ``context`` (before any process starts).

        The default checks what every device shares: one process per machine for a device
        that allows no more, a ``visible_devices`` setting it can honour, and no more
        processes per machine than visible devices where each process needs its own.
        Override to add your own (call ``super().check(context)``).
        """
        config, cluster = context.config, context.cluster
        problems = []
        if not cls.multi_process and cluster.local_world_size() > 1:
            problems.append(f"device '{cls.name}' runs one process per machine but this job starts "
                            f"{cluster.local_world_size()}; launch with --nproc-per-node 1")
        if config.visible_devices and not cls.visible_devices_variable():
            problems.append(f"visible_devices is set but device '{cls.name}' has no visible-devices variable; "
                            f"remove visible_devices")
        if cls.one_process_per_device and cluster.world_size() > 1:
            count, per_machine = cls.visible_count(config), cluster.local_world_size()
            if count and per_machine > count:
                variable = cls.visible_devices_variable()
                problems.append(f"device {cls.name}: {per_machine} processes per machine but only {count} "
                                f"device(s) visible; {cls.dist_backend()} needs one device per process: launch at "
                                f"most {count} processes per machine or make more devices visible (visible_devices"
                                + (f" / {variable}" if variable else "") + ")")
        return problems

    @classmethod
    def launch_env(cls, local_world_size: int, config: Any = None) -> dict[str, str]:
        """Environment the launcher gives workers beyond the visible devices (``config``: the
        resolved config, for settings of the device's own section); the default adds nothing.

        Must not initialise the device."""
        return {}

    @classmethod
    def visible_devices_variable(cls) -> str | None:
        """The variable that selects which devices a process sees (override when it depends on the build)."""
        return cls.visible_devices_env

    @classmethod
    def worker_env(cls, config: Any, local_world_size: int) -> dict[str, str]:
        """Everything the launcher sets for workers on this device: :meth:`launch_env` plus
        ``config.visible_devices`` in :meth:`visible_devices_variable`."""
        env = dict(cls.launch_env(local_world_size, config))
        variable = cls.visible_devices_variable()
        if getattr(config, "visible_devices", None) and variable:
            env[variable] = config.visible_devices
        return env

    @classmethod
    def visible_count(cls, config: Any) -> int:
        """How many devices the workers will see: ``visible_devices`` if set, else the detected count."""
        if getattr(config, "visible_devices", None):
            return len(config.visible_devices.split(","))
        return cls.device_count()

    @classmethod
    def dist_backend(cls) -> str:
        """The process-group backend for this device (nccl, xccl, hccl, gloo...)."""
        if cls.collective_backend:
            return cls.collective_backend
        return torch.distributed.get_default_backend_for_device(cls.torch_type())

    @classmethod
    def memory_capacity(cls) -> dict[int, tuple[int, int]]:
        """``{index: (free_bytes, total_bytes)}`` for every device of this kind the process sees.

        Big-model placement asks it (``device_map="auto"``, ``get_max_memory``). The default
        reads ``torch.accelerator.get_memory_info`` when this is torch's current accelerator and
        the class keeps the generic :meth:`mem_get_info`; otherwise the class's own
        ``mem_get_info`` on an instance per index. Override when the device can say it cheaper.
        """
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        generic = (cls.mem_get_info is DeviceBackend.mem_get_info and accelerator is not None
                   and accelerator.type == cls.torch_type() and hasattr(torch.accelerator, "get_memory_info"))
        out = {}
        for index in range(cls.device_count()):
            free, total = torch.accelerator.get_memory_info(index) if generic else cls(index).mem_get_info()
            out[index] = (int(free), int(total))
        return out

    @classmethod
    def placement_budget(cls) -> dict[int, int]:
        """Bytes ``device_map="auto"`` may fill on each index: the free memory less
        ``placement_headroom`` of the total (never negative)."""
        return {index: max(0, free - int(total * cls.placement_headroom))
                for index, (free, total) in cls.memory_capacity().items()}

    # -- per-process operations ---------------------------------------------------------
    def process_group_kwargs(self) -> dict[str, Any]:
        """Extra ``init_process_group`` arguments (``device_id`` binds the group to this device)."""
        return {"device_id": self.device}

    def ddp_device_ids(self) -> list[int] | None:
        """``device_ids`` for DistributedDataParallel."""
        return [self.index]

    @property
    def module(self):
        return torch.get_device_module(self.torch_type())

    def set_current(self) -> None:
        torch.accelerator.set_device_index(self.index)

    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed_all(seed)

    def get_rng_state(self) -> list[torch.Tensor]:
        """RNG state of every device of this type this process can see."""
        return [state.cpu() for state in self.module.get_rng_state_all()]

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        self.module.set_rng_state_all(states)

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.index)

    def memory_stats(self) -> dict[str, int]:
        """Bytes: ``allocated``, ``peak_allocated``, ``reserved``, ``free``, ``total``."""
        stats = {
            "allocated": torch.accelerator.memory_allocated(self.index),
            "peak_allocated": torch.accelerator.max_memory_allocated(self.index),
            "reserved": torch.accelerator.memory_reserved(self.index),
        }
        free, total = self.mem_get_info()
        stats.update(free=free, total=total)
        return stats

    def mem_get_info(self) -> tuple[int, int]:
        return self.module.mem_get_info(self.index)

    def reset_peak_memory(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.index)

    def empty_cache(self) -> None:
        torch.accelerator.empty_cache()

    @classmethod
    def supports_autocast(cls, dtype: torch.dtype) -> bool:
        if dtype == torch.float16:
            return cls.supports_fp16_autocast
        if dtype == torch.bfloat16:
            return cls.supports_bf16_autocast
        return False

    def autocast(self, dtype: torch.dtype, enabled: bool = True, cache_enabled: bool | None = None):
        kwargs = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
        return torch.autocast(self.torch_type(), dtype=dtype, enabled=enabled, **kwargs)

    def grad_scaler(self, **kwargs):
        return torch.amp.GradScaler(self.torch_type(), **kwargs)

    def optimizer_step(self, optimizer, **kwargs):
        """Run one optimizer step; lazy-tensor devices override to add their own syncing."""
        return optimizer.step(**kwargs)

    def after_step(self) -> None:
        """Called after each optimizer step (lazy-tensor devices mark the step here)."""

    def wrap_dataloader(self, dataloader):
        """Device-aware data loading (a lazy-tensor device's parallel loader); the default is the loader."""
        return dataloader

    def peak_flops(self, dtype: Any) -> float | None:
        """The device's peak dense math rate for ``dtype`` in FLOP/s (plugin API 1.3), or ``None``: unknown.

        ``dtype`` is a torch dtype or one of the keys of :data:`FLOPS_KEYS` (``"bf16"``, ``"fp16"``, ``"fp32"``,
        ``"tf32"``, ``"fp8"``, ``"fp4"``); :func:`flops_key` turns either into the key. Telemetry divides the
        achieved rate by it for MFU, and logs no MFU where it is ``None``. A plugin returns the figure its vendor
        publishes for this device (dense, no structured sparsity), for the exact product it detects; it never
        guesses: a device it cannot identify, or a dtype without a published figure, is ``None``. The base
        knows no device, so it returns ``None``.
        """
        return None

    def record_memory_history(self, max_entries: int) -> bool:
        """Start recording the allocator's history for :meth:`dump_memory_snapshot` (plugin API 1.3); ``False``
        (the base) where the device cannot."""
        return False

    def dump_memory_snapshot(self, path: str) -> bool:
        """Write the allocator's snapshot to ``path`` in torch's format (https://pytorch.org/memory_viz); ``False``
        (the base) where the device cannot. ``path`` is new: torchbay never asks to overwrite a file."""
        return False

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": str(self.device), "count": self.device_count()}
        name = getattr(self.module, "get_device_name", None)
        if name is not None:
            out["name"] = name(self.index)
        return out

