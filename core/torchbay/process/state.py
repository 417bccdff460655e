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

from typing import Any

import torch

from torchbay.config.files import read_packaged_yaml
from torchbay.errors import TorchbayError
from torchbay.process import current, running
from torchbay.process.distributed_type import (  # noqa: F401 (Accelerate's names, served from here)
    DistributedType,
    distributed_type_for,
    distributed_type_names,
)
from torchbay.process.queries import ProcessQueries


def accelerate_api_table() -> dict[str, Any]:
    return read_packaged_yaml("torchbay", "resources/accelerate_api.yaml")


class StateResetError(TorchbayError, AttributeError):
    """A state was read after ``_reset_state()`` and before a new ``Accelerator``/``PartialState``."""


#: Accelerate's attribute names of the shared state -> the current run's fields
_RECORD_FIELDS = {"device": "device", "distributed_type": "distributed_type", "num_processes": "num_processes",
                  "process_index": "process_index", "local_process_index": "local_process_index",
                  "backend": "backend", "debug": "debug", "fork_launched": "fork_launched",
                  "_mixed_precision": "mixed_precision", "_cpu": "cpu", "_strategy": "strategy"}


def _fill(cpu: bool, kwargs: dict[str, Any]) -> None:
    """Fill the empty shared dict: from the current run, or from one started now (which fills it as it starts)."""
    run = current.peek()
    if run is not None:
        _show(run)
        return
    timeout = kwargs.get("timeout")
    current.start_run(cpu=cpu, backend=kwargs.get("backend"), timeout_s=timeout.total_seconds() if timeout else None)


def _show(run: current.CurrentRun) -> None:
    """Fill Accelerate's shared dict (what ``PartialState``/``AcceleratorState`` instances read) from ``run``."""
    PartialState._shared_state.update({name: getattr(run, field) for name, field in _RECORD_FIELDS.items()})


def _mirror(run: current.CurrentRun | None) -> None:
    """Accelerate's shared dict follows the current run: filled from it, emptied when it is forgotten."""
    PartialState._shared_state.clear()
    if run is not None:
        _show(run)


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
            _fill(cpu, kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        """``PartialState().debug = True`` and the like reach the current run, which the services read."""
        run = current.peek()
        if run is not None and name in _RECORD_FIELDS and self.__dict__ is PartialState._shared_state:
            setattr(run, _RECORD_FIELDS[name], value)
        object.__setattr__(self, name, value)

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
        """Forget the shared state and the current run (the process group stays); the next instance rebuilds it."""
        current.clear_current()  # the shared dict follows (_mirror)

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
        current.current().strategy.barrier()

    def set_device(self) -> None:
        current.current().strategy.device_backend.set_current()

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy the process group (the default one unless ``group`` is given)."""
        run = current.peek()
        fork_launched = run.fork_launched if run is not None else current.fork_launched_from_env()
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
            _fill(cpu, kwargs)
        if mixed_precision is not None and mixed_precision != self._mixed_precision:
            raise TorchbayError(f"AcceleratorState already holds mixed_precision={self._mixed_precision!r}; pass "
                                f"mixed_precision={mixed_precision!r} to the Accelerator you create instead")

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        current.clear_current()  # the shared dict follows (_mirror)

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    @property
    def is_fsdp2(self) -> bool:
        return bool(getattr(current.current().strategy, "is_fully_sharded_v2", False))

    def __getattr__(self, name: str):
        """Accelerate's backend objects (``fsdp_plugin``...) come from the selected strategy; those it
        does not show are ``None``, as in Accelerate when that backend is not in use."""
        run = current.peek() if self.__dict__ else None
        strategy = run.strategy if run is not None else None
        if strategy is not None and not name.startswith("_"):
            objects = strategy.accelerate_state_objects()
            if name in objects:
                return objects[name]
            if name in PLUGIN_ATTRIBUTES:
                return None
        return super().__getattr__(name)

    def __repr__(self) -> str:
        return super().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"


current.watch(_mirror)
