"""Accelerate's process-state objects: ``PartialState``, ``AcceleratorState``, ``DistributedType``.

``PartialState()`` answers "which process am I, on which device" and joins the process group
when the job has several processes, without an ``Accelerator`` (as Accelerate's does). Like
Accelerate's, every instance shares one state per process. An ``Accelerator`` fills it in
when it starts, and ``AcceleratorState()`` adds what the latest ``Accelerator`` chose
(``mixed_precision``). Collectives go through the selected strategy's plain methods.

``DistributedType`` is Accelerate's enum; which member a run has comes from the selected
strategy and device (``distributed_type_for``), never from a list of backends in the core.
"""

from __future__ import annotations

import enum
import functools
import importlib.resources
import json
import os
from typing import Any

import torch

from torchbay.config.files import read_packaged_yaml
from torchbay.config.resolve import resolve_config
from torchbay.errors import ConfigError, TorchbayError
from torchbay.plugin.manager import get_plugin_manager
from torchbay.plugin.selection import build_context
from torchbay.process import running
from torchbay.process.queries import ProcessQueries


def accelerate_api_table() -> dict[str, Any]:
    return read_packaged_yaml("torchbay", "resources/accelerate_api.yaml")


@functools.lru_cache(maxsize=None)
def distributed_type_names() -> list[str]:
    """Accelerate's ``DistributedType`` member names (``resources/distributed_types.json``)."""
    text = importlib.resources.files("torchbay").joinpath("resources/distributed_types.json").read_text("utf-8")
    return json.loads(text)["members"]


DistributedType = enum.Enum("DistributedType", [(n, n) for n in distributed_type_names()],
                            type=str, module=__name__)
DistributedType.__doc__ = "Accelerate's kinds of run; ``accelerator.distributed_type`` is one of them."
DistributedType.__str__ = lambda self: self.value  # type: ignore[method-assign]


def distributed_type_for(strategy: Any, device_backend: Any) -> DistributedType:
    """The ``DistributedType`` member that describes a run of ``strategy`` on ``device_backend``."""
    members = DistributedType.__members__
    explicit = getattr(strategy, "accelerate_distributed_type", None)
    if explicit in members:
        return DistributedType[explicit]
    multi = getattr(device_backend, "accelerate_distributed_type", None) or f"MULTI_{device_backend.name.upper()}"
    if strategy.name in ("single", "ddp"):
        if strategy.world_size <= 1:
            return DistributedType.NO
        return DistributedType[multi] if multi in members else DistributedType.MULTI_CPU
    own = strategy.name.upper()
    if own in members:
        return DistributedType[own]
    return DistributedType[multi] if strategy.world_size > 1 and multi in members else DistributedType.NO


class StateResetError(TorchbayError, AttributeError):
    """A state was read after ``_reset_state()`` and before a new ``Accelerator``/``PartialState``."""


#: Accelerate's variable naming one process's device (``<type>:<index>``), read as its PartialState reads it
TORCH_DEVICE_ENV = "ACCELERATE_TORCH_DEVICE"


def start_device_backend(context: Any) -> Any:
    """The selected device backend for this process, made current: on the device of its local rank, or on the one
    ``ACCELERATE_TORCH_DEVICE`` names (its type must be the run's device type)."""
    backend = context.device_backend_cls(context.cluster.local_rank())
    wanted = os.environ.get(TORCH_DEVICE_ENV)
    if wanted:
        try:
            device = torch.device(wanted)
        except RuntimeError as exc:
            raise ConfigError(f"{TORCH_DEVICE_ENV}={wanted!r} is not a torch device ({exc}); unset it or give "
                              f"one such as '<type>:<index>'") from None
        if device.type != backend.device.type:
            raise ConfigError(f"{TORCH_DEVICE_ENV}={wanted!r} names a {device.type} device, but this run's device is "
                              f"'{backend.name}' ({backend.device.type}): set device: {device.type} in the config, "
                              f"or unset {TORCH_DEVICE_ENV}")
        backend.device, backend.index = device, device.index or 0
    backend.set_current()
    return backend


class PartialState(ProcessQueries):
    """Process index, device and process group, shared by every instance in the process.

    ``cpu=True`` selects the cpu device; ``kwargs`` are ``InitProcessGroupKwargs`` fields
    (``backend``, ``timeout``).
    """

    _shared_state: dict[str, Any] = {}
    _known_attrs = ("device", "distributed_type", "num_processes", "process_index", "local_process_index",
                    "backend", "debug", "_strategy")

    def __init__(self, cpu: bool = False, **kwargs: Any):
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self._start(cpu, kwargs)

    def _start(self, cpu: bool, kwargs: dict[str, Any]) -> None:
        args: dict[str, Any] = {"device": "cpu"} if cpu else {}
        if kwargs.get("backend"):
            args["process_group_backend"] = kwargs["backend"]
        if kwargs.get("timeout"):
            args["process_group_timeout_s"] = kwargs["timeout"].total_seconds()
        pm = get_plugin_manager()
        context = build_context(resolve_config(args=args, pm=pm), pm)
        context.device_backend = start_device_backend(context)
        strategy = context.strategy = context.strategy_cls(context)
        strategy.setup_environment(timeout_s=context.config.process_group_timeout_s)
        running.register_process_group_owner(strategy)
        self._adopt(strategy, cpu=cpu, mixed_precision=context.config.mixed_precision)

    def _adopt(self, strategy: Any, cpu: bool = False, mixed_precision: str = "no") -> None:
        """Fill the shared state from a started strategy (the Accelerator's, or our own)."""
        backend = strategy.device_backend
        state = PartialState._shared_state
        state.update(_strategy=strategy, _cpu=cpu, _mixed_precision=mixed_precision, device=backend.device,
                     num_processes=strategy.world_size, process_index=strategy.rank,
                     local_process_index=strategy.local_rank,
                     distributed_type=distributed_type_for(strategy, backend),
                     backend=backend.dist_backend() if strategy.world_size > 1 else None, debug=False)
        state["fork_launched"] = os.environ.get("FORK_LAUNCHED", "0") not in ("0", "", "false", "False")

    def __getattr__(self, name: str):
        if name in type(self)._known_attrs:
            raise StateResetError(
                f"`{type(self).__name__}` object has no attribute `{name}`. This happens if "
                f"`{type(self).__name__}._reset_state()` was called and an `Accelerator` or `PartialState` was not "
                f"reinitialized: create a new one before using it")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __repr__(self) -> str:
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: {self.distributed_type}{backend}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")

    def __reduce__(self):
        return type(self), ()  # unpickles as this process's shared state

    @staticmethod
    def _reset_state() -> None:
        """Forget the shared state (the process group stays); the next instance rebuilds it."""
        PartialState._shared_state.clear()

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    @property
    def use_distributed(self) -> bool:
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def default_device(self) -> torch.device:
        return self.device

    # -- process control ------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        self._strategy.barrier()

    def set_device(self) -> None:
        self._strategy.device_backend.set_current()

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy the process group (the default one unless ``group`` is given)."""
        fork_launched = self.__dict__.get("fork_launched",
                                          os.environ.get("FORK_LAUNCHED", "0") not in ("0", "", "false", "False"))
        if fork_launched and group is None:
            return
        if group is not None:
            torch.distributed.destroy_process_group(group)
            return
        running.teardown_owners()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


#: Accelerate's ``AcceleratorState`` attributes holding a backend's plugin object (None when not in use)
PLUGIN_ATTRIBUTES = ("fsdp_plugin", "deepspeed_plugin", "torch_tp_plugin", "megatron_lm_plugin")


class AcceleratorState(PartialState):
    """``PartialState`` plus what the latest ``Accelerator`` chose (``mixed_precision``, its strategy)."""

    _known_attrs = PartialState._known_attrs + ("_mixed_precision",)

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any):
        self.__dict__ = PartialState._shared_state
        if not self._shared_state:
            self._start(cpu, {k: v for k, v in kwargs.items() if k in ("backend", "timeout")})
        if mixed_precision is not None and mixed_precision != self._mixed_precision:
            raise TorchbayError(f"AcceleratorState already holds mixed_precision={self._mixed_precision!r}; pass "
                                f"mixed_precision={mixed_precision!r} to the Accelerator you create instead")

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        PartialState._shared_state.clear()

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    @property
    def is_fsdp2(self) -> bool:
        return bool(getattr(self._strategy, "is_fully_sharded_v2", False))

    def __getattr__(self, name: str):
        """Accelerate's backend objects (``fsdp_plugin``...) come from the selected strategy; those it
        does not show are ``None``, as in Accelerate when that backend is not in use."""
        strategy = self.__dict__.get("_strategy")
        if strategy is not None and not name.startswith("_"):
            objects = strategy.accelerate_state_objects()
            if name in objects:
                return objects[name]
            if name in PLUGIN_ATTRIBUTES:
                return None
        return super().__getattr__(name)

    def __repr__(self) -> str:
        return super().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"
