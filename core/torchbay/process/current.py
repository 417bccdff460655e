"""The current run of this process: one small typed record, the single home of "which process am I, on which
device, through which collectives".

The latest ``Accelerator`` sets it when it starts (:func:`describe`, then :func:`set_current`); without
one, the first service that needs it starts a run from the config (:func:`start_run`), as Accelerate's
``PartialState()`` does. Data loading, tracking, seeding and the compat helpers read it with :func:`current` (or
:func:`peek`, which starts nothing). Accelerate's state views follow every change (:func:`watch`).
``PartialState`` and ``AcceleratorState`` (``process/state.py``) are Accelerate's views over it: their shared
dict is filled from it and cleared with it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from torchbay.errors import ConfigError
from torchbay.process import running
from torchbay.process.distributed_type import distributed_type_for
from torchbay.registry.manager import get_plugin_manager
from torchbay.registry.resolve import resolve_config
from torchbay.registry.selection import build_context


@dataclass
class CurrentRun:
    """What every service of this process may ask about the run (Accelerate's names where it has them)."""

    #: the selected strategy: collectives, ranks, the device backend (``strategy.device_backend``)
    strategy: Any
    device: torch.device
    num_processes: int
    process_index: int
    local_process_index: int
    #: Accelerate's ``DistributedType`` member for this run
    distributed_type: Any
    #: the process group's backend name (``None`` with one process)
    backend: str | None
    mixed_precision: str = "no"
    cpu: bool = False
    fork_launched: bool = False
    #: compare shapes across processes before each collective (``PartialState().debug = True``)
    debug: bool = False
    #: the latest Accelerator's gradient state, held weakly (a dropped Accelerator's loaders must not stay alive)
    gradient_state_ref: Callable[[], Any] | None = field(default=None, repr=False)

    @property
    def gradient_state(self) -> Any:
        return self.gradient_state_ref() if self.gradient_state_ref is not None else None

    def hold_gradient_state(self, gradient_state: Any) -> None:
        self.gradient_state_ref = weakref.ref(gradient_state)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0


_current: CurrentRun | None = None
#: called with the new run (or ``None``) whenever it changes: Accelerate's state views mirror it
_watchers: list[Callable[[CurrentRun | None], None]] = []


def watch(watcher: Callable[[CurrentRun | None], None]) -> None:
    _watchers.append(watcher)
    watcher(_current)


def _changed() -> None:
    for watcher in _watchers:
        watcher(_current)


def set_current(run: CurrentRun) -> CurrentRun:
    global _current
    _current = run
    _changed()
    return run


def clear_current() -> None:
    """Forget the run (its process group stays); the next :func:`current` starts one again."""
    global _current
    _current = None
    _changed()


def peek() -> CurrentRun | None:
    """The run, or ``None`` when none was started (nothing is started here)."""
    return _current


def current() -> CurrentRun:
    """The run, started from the config (every setting at its default) when there is none yet."""
    return _current if _current is not None else start_run()


def fork_launched_from_env() -> bool:
    return os.environ.get("FORK_LAUNCHED", "0") not in ("0", "", "false", "False")


def describe(strategy: Any, cpu: bool = False, mixed_precision: str = "no",
             distributed_type: Any = None) -> CurrentRun:
    """The record of a run of the started ``strategy`` (its device backend made current)."""
    backend = strategy.device_backend
    return CurrentRun(strategy=strategy, device=backend.device, num_processes=strategy.world_size,
                      process_index=strategy.rank, local_process_index=strategy.local_rank,
                      distributed_type=distributed_type or distributed_type_for(strategy, backend),
                      backend=backend.dist_backend() if strategy.world_size > 1 else None,
                      mixed_precision=mixed_precision, cpu=cpu, fork_launched=fork_launched_from_env())


def start_run(cpu: bool = False, backend: str | None = None, timeout_s: float | None = None) -> CurrentRun:
    """Start a run without an ``Accelerator`` (Accelerate's ``PartialState()``): the config's device and strategy,
    the process group joined when the job has several processes; it becomes the current run."""
    args: dict[str, Any] = {"device": "cpu"} if cpu else {}
    if backend:
        args["process_group_backend"] = backend
    if timeout_s:
        args["process_group_timeout_s"] = timeout_s
    pm = get_plugin_manager()
    context = build_context(resolve_config(args=args, pm=pm), pm)
    context.device_backend = start_device_backend(context)
    strategy = context.strategy = context.strategy_cls(context)
    strategy.setup_environment(timeout_s=context.config.process_group_timeout_s)
    running.register_process_group_owner(strategy)
    return set_current(describe(strategy, cpu=cpu, mixed_precision=context.config.mixed_precision))


#: Accelerate's variable naming one process's device (``<type>:<index>``), read as its PartialState reads it
TORCH_DEVICE_ENV = "ACCELERATE_TORCH_DEVICE"


def start_device_backend(context: Any) -> Any:
    """The selected device backend for this process, made current: on the device of its local rank, or on the one
    ``ACCELERATE_TORCH_DEVICE`` names (its type must be the run's device type)."""
    device_backend = context.device_backend_cls(context.cluster.local_rank())
    wanted = os.environ.get(TORCH_DEVICE_ENV)
    if wanted:
        try:
            device = torch.device(wanted)
        except RuntimeError as exc:
            raise ConfigError(f"{TORCH_DEVICE_ENV}={wanted!r} is not a torch device ({exc}); unset it or give "
                              f"one such as '<type>:<index>'") from None
        if device.type != device_backend.device.type:
            raise ConfigError(f"{TORCH_DEVICE_ENV}={wanted!r} names a {device.type} device, but this run's device is "
                              f"'{device_backend.name}' ({device_backend.device.type}): set device: {device.type} in "
                              f"the config, or unset {TORCH_DEVICE_ENV}")
        device_backend.device, device_backend.index = device, device.index or 0
    device_backend.set_current()
    return device_backend
