"""The ``Accelerator``'s process control and collectives, with Accelerate's names.

A mixin of :class:`~torchbay.accelerator.accelerator.Accelerator`: which process runs what, the
collectives over nested structures, the breakpoint trigger, ``join_uneven_inputs`` and
``trigger_sync_in_backward``. Everything goes through the accelerator's strategy.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

import torch

from torchbay.data import operations
from torchbay.process.queries import ProcessQueries
from torchbay.process.state import PartialState

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.strategy import Strategy
    from torchbay.data.gradient_state import GradientState
    from torchbay.process.state import AcceleratorState


class ProcessControl(ProcessQueries):
    """Methods of the Accelerator that need only its strategy (``self.strategy``)."""

    # what they read from the Accelerator
    strategy: Strategy
    state: AcceleratorState
    gradient_state: GradientState
    device: torch.device
    _dataloaders: list[Any]  # the prepared data loaders (checkpointed.py)

    # -- where am I (read from the shared state, as Accelerate does: after ``AcceleratorState._reset_state()``
    # they raise StateResetError until a new Accelerator or PartialState is made) ----------------------
    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    # Accelerate answers these from the process's PartialState, which AcceleratorState._reset_state() keeps: a
    # script may still ask them between a reset and its next Accelerator
    @property
    def is_main_process(self) -> bool:
        return PartialState().is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return PartialState().is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return PartialState().is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    # -- collectives -------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return operations.gather_with(self.strategy, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather, dropping the samples repeated to even out the last round of batches.

        Under tensor or context parallelism the ranks of one group read the same batch: only
        one rank per data-parallel part is kept, so each sample comes back once.
        """
        is_tensorish = not use_gather_object and _contains_tensor(input_data)
        sources = self._data_parallel_sources()
        if is_tensorish:
            data = self.gather(input_data)
            if sources is not None:
                world = self.strategy.world_size
                data = operations.recursively_apply(
                    lambda t: t.reshape(world, -1, *t.shape[1:])[sources].reshape(-1, *t.shape[1:]), data)
        else:
            parts = self.strategy.all_gather_object(input_data)
            if sources is not None:
                parts = [parts[r] for r in sources]
            data = [x for part in parts for x in (part if isinstance(part, list) else [part])]
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder > 0:  # 0 or -1: nothing was added
            return operations.truncate(data, remainder) if is_tensorish else data[:remainder]
        return data

    def _data_parallel_sources(self) -> list[int] | None:
        """One global rank per data-parallel part, in part order; None when every rank reads its own."""
        strategy = self.strategy
        if strategy.data_parallel_size == strategy.world_size:
            return None
        cached = getattr(self, "_dp_sources", None)
        if cached is None:  # every rank gets here (gather_for_metrics is collective), once
            parts = strategy.all_gather_object(strategy.data_parallel_rank)
            cached = [parts.index(part) for part in range(strategy.data_parallel_size)]
            self._dp_sources = cached
        return cached

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return operations.reduce_with(self.strategy, tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return operations.pad_across_processes_with(self.strategy, tensor, dim, pad_index, pad_first)

    def wait_for_everyone(self) -> None:
        self.strategy.barrier()

    # -- breakpoint trigger ----------------------------------------------------------------
    def set_trigger(self) -> None:
        """Raise a flag on this process that :meth:`check_trigger` sees on every process."""
        self._trigger_flag = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called :meth:`set_trigger` since the last check (a collective)."""
        flag = getattr(self, "_trigger_flag", None)
        if flag is None:
            flag = torch.tensor(0, device=self.device)
        total = self.strategy.all_reduce(flag, op="sum")
        if int(total.item()) >= 1:
            self._trigger_flag = torch.tensor(0, device=self.device)
            return True
        return False

    # -- gradient synchronisation and uneven inputs -------------------------------------
    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: Any):
        """Make the next backward of ``model`` synchronise gradients even inside ``no_sync``."""
        with self.strategy.trigger_sync_in_backward(model):
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None):
        """Let processes with fewer batches finish while the others go on (torch's ``Join``).

        ``even_batches`` overrides that setting of every prepared map-style loader inside the block.
        """
        join = self.strategy.join_context if self.strategy.joins_uneven_inputs else None
        if self.num_processes <= 1 or join is None or not all(self.strategy.is_wrapped(j) for j in joinables):
            warnings.warn("join_uneven_inputs is only supported for multi-GPU, multi-CPU (or any multi-device) "
                          "training with the ddp strategy; nothing is joined here", UserWarning, stacklevel=3)
            yield
            return
        restore = []
        if even_batches is not None:
            iterable = False
            for loader in self._dataloaders:
                sampler = getattr(loader, "batch_sampler", None)
                if not hasattr(sampler, "even_batches"):  # not a sharded batch sampler: an iterable dataset's loader
                    iterable = True
                    continue
                restore.append((sampler, sampler.even_batches))
                sampler.even_batches = even_batches
            if iterable:
                warnings.warn("Overriding even_batches is only supported for map-style datasets; the iterable "
                              "loaders keep their setting", UserWarning, stacklevel=3)
        try:
            with join(joinables):
                yield
        finally:
            for sampler, value in restore:
                sampler.even_batches = value


def _contains_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return any(_contains_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return bool(data) and all(_contains_tensor(v) for v in data)
    return False
