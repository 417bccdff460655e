"""``dispatch_batches``: the main process reads every global batch and each process gets its slice
(Accelerate's ``DataLoaderDispatcher``; the default for iterable datasets placed on the device).

Without ``split_batches`` a global batch is ``num_processes`` batches of the inner loader put end to end; with it,
one batch. The last global batch, when its size is not a multiple of the number of processes, is completed with
the first samples of the epoch so that every process gets as many; ``remainder`` then says how many were real,
and ``gather_for_metrics`` drops the rest. Every process makes the inner iterator (it draws the same seeds on all,
as Accelerate's does) but only the main process reads from it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchbay.data.loader import PreparedDataLoader
from torchbay.data.operations import find_batch_size
from torchbay.errors import ConfigError
from torchbay.process.current import current


class DataLoaderDispatcher(PreparedDataLoader):
    """A prepared loader whose batches the main process reads and sends out (Accelerate's name and signature)."""

    def __init__(self, dataset, split_batches: bool = False, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 slice_fn=None, torch_device_mesh=None, iteration: int = 0, **kwargs):
        super().__init__(dataset, skip_batches=skip_batches, use_stateful_dataloader=use_stateful_dataloader,
                         _drop_last=_drop_last, _non_blocking=_non_blocking, torch_device_mesh=torch_device_mesh,
                         iteration=iteration, **kwargs)
        state = current()
        self.split_batches = split_batches
        self.slice_fn = slice_fn if slice_fn is not None else _slice_fn
        self.num_processes, self.process_index = state.num_processes, state.process_index
        self.device = state.device
        self._stop_iteration = False

    def __len__(self) -> int:
        whole = len(self.base_dataloader)
        if self.split_batches:
            return whole
        return whole // self.num_processes if self._drop_last else math.ceil(whole / self.num_processes)

    @property
    def total_batch_size(self) -> int:
        per = self.batch_size if self.batch_size is not None else getattr(self.batch_sampler, "batch_size", None)
        return per if self.split_batches else per * self.num_processes

    def begin(self) -> None:
        """The remainder is only known at the last batch (the dataset may have no length)."""
        self.reset()
        self.gradient_state.add_dataloader(self)

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        holder = self.batch_sampler
        if hasattr(getattr(holder, "sampler", None), "set_epoch"):
            holder.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    # -- one epoch ----------------------------------------------------------------------------
    def _iterate(self, skip: int):
        self.begin()
        try:
            self.set_epoch(self.iteration)
            yield from self._serve(self._dispatched(self._epoch_iterator(0), skip), skip, look_ahead=False)
        finally:
            self._rng.finish()
            self.end()

    def _fetch(self, iterator) -> tuple[Any, bool]:
        """On the main process, the next global batch and whether the inner loader is exhausted; sent to all."""
        found, stopped = None, False
        if self.strategy.rank == 0:
            parts = []
            wanted = 1 if self.split_batches else self.num_processes
            while len(parts) < wanted:
                batch = next(iterator, _END)
                if batch is _END:
                    stopped = True
                    break
                parts.append(batch)
            if parts and not (stopped and (self.split_batches or self._drop_last)):
                found = parts[0] if len(parts) == 1 else _concatenate(parts)
        return self.strategy.broadcast_object((found, stopped))

    def _dispatched(self, iterator, skip: int):
        """This process's slice of every global batch, the last one completed; ``skip`` of them are dropped."""
        n, me = self.num_processes, self.process_index
        first = None
        batch, stopped = self._fetch(iterator)
        index = 0
        while batch is not None:
            if first is None and not self._drop_last:
                first = self.slice_fn(batch, slice(0, n), process_index=me, num_processes=n)
            observed = find_batch_size(batch)
            per = observed // n
            last = stopped
            if not stopped:
                upcoming, stopped = self._fetch(iterator)
                last = upcoming is None
            else:
                upcoming = None
            if last and not self._drop_last and observed % n:
                batch, per = _concatenate([batch, first]), per + 1
            if last:
                self.end_of_dataloader, self.remainder = True, observed
            if index >= skip:
                yield self.slice_fn(batch, slice(me * per, (me + 1) * per), process_index=me, num_processes=n)
            index += 1
            batch = upcoming


_END = object()


def _slice_fn(data: Any, tensor_slice: slice, process_index: int | None = None, num_processes: int | None = None):
    """Accelerate's ``slice_tensors``: every tensor of ``data`` sliced along its first dimension."""
    if isinstance(data, torch.Tensor):
        return data[tensor_slice]
    if isinstance(data, dict):
        return type(data)({k: _slice_fn(v, tensor_slice) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_slice_fn(v, tensor_slice) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_slice_fn(v, tensor_slice) for v in data)
    return data


def _concatenate(parts: list[Any]) -> Any:
    """Batches of the same structure put end to end along the first dimension."""
    head = parts[0]
    if isinstance(head, torch.Tensor):
        try:
            return torch.cat(parts, dim=0)
        except RuntimeError as error:
            raise ConfigError("dispatch_batches puts several batches end to end, and these differ in shape: pass "
                              "dispatch_batches=False (each process reads its own batches) or split_batches=True "
                              "(one batch is cut into slices)") from error
    if isinstance(head, dict):
        return type(head)({k: _concatenate([p[k] for p in parts]) for k in head})
    if isinstance(head, tuple) and hasattr(head, "_fields"):
        return type(head)(*(_concatenate(list(items)) for items in zip(*parts)))
    if isinstance(head, (list, tuple)):
        return type(head)(_concatenate(list(items)) for items in zip(*parts))
    return head
