"""Prepared data loaders: ``torch.utils.data.DataLoader`` subclasses with Accelerate's names and constructors.

A prepared loader is a ``DataLoader`` (``isinstance`` holds, its ``dataset``, ``sampler``, ``batch_sampler`` and
``batch_size`` are the sharded ones, as on Accelerate) that reads from an inner ``base_dataloader``. Iterating it
moves batches to the device, tells the gradient state where the epoch ends and counts epochs (``iteration``,
passed to ``set_epoch`` of the samplers and dataset as Accelerate does). On top of Accelerate, it saves its epoch,
its position and the shuffling RNG at the epoch's start (``state_dict``), so ``load_state`` then
``skip_first_batches`` (or, with ``use_stateful_dataloader``, plain iteration) serves exactly the batches an
uninterrupted run would have. ``prepare_data_loader`` (torchbay.data.prepare) builds them;
``DataLoaderDispatcher`` lives in torchbay.data.dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from torchbay.data.epoch import DataLoaderStateMixin, EpochBatches, EpochRng
from torchbay.data.gradient_state import GradientState
from torchbay.data.operations import send_to_device
from torchbay.data.sharding import (  # noqa: F401 (still read from here; torchbay.data serves Accelerate's names)
    BatchSamplerShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    ShardedBatchSampler,
    SkipBatchSampler,
)
from torchbay.process.current import current

#: arguments that decide which indices a loader reads: a prepared loader rebuilds them
_INDEX_ARGS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
_END = object()


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` (tensors in nested lists, tuples, dicts, objects with ``.to``) on ``device``."""
    return send_to_device(batch, device, non_blocking=non_blocking)


def get_sampler(dataloader: DataLoader) -> Any:
    """The sampler behind a loader's batch sampler (or behind its sampler, when that is a batch sampler)."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


class PreparedDataLoader(DataLoader, DataLoaderStateMixin):
    """The part every prepared loader shares: construction, epochs, ``set_epoch``, sizes, resume state."""

    def __init__(self, dataset, device=None, rng_types=None, synchronized_generator=None, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 torch_device_mesh=None, iteration: int = 0, **kwargs):
        super().__init__(dataset, **kwargs)
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader
        self.torch_device_mesh = torch_device_mesh
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.iteration = iteration
        self.gradient_state = GradientState()
        self.seed: int | None = None  # the SeedableRandomSampler's seed (saved with the position)
        self.batches_yielded = 0
        self.in_epoch = False
        self._pending_skip = 0  # a stateful loader's restored position, served by the next iteration
        self._resuming = False  # the next epoch continues one interrupted after its iterator was made
        self._strategy = None  # the collectives (PartialState's strategy unless prepare gives one)
        self._rng, self.base_dataloader = self._make_base(dataset, kwargs)
        self._batches = self.base_dataloader  # what is iterated (a device plugin may wrap it)

    def _make_base(self, dataset, kwargs: dict) -> tuple[EpochRng, DataLoader]:
        """The inner loader: the same arguments, reading its indices through :class:`EpochBatches`."""
        rest = {k: v for k, v in kwargs.items() if k not in _INDEX_ARGS}
        if isinstance(dataset, IterableDataset):
            return EpochRng(None), DataLoader(dataset, batch_size=self.batch_size, drop_last=self.drop_last, **rest)
        if self.batch_sampler is not None:
            rng = EpochRng(self.batch_sampler)
            return rng, DataLoader(dataset, batch_sampler=EpochBatches(self.batch_sampler, rng), **rest)
        rng = EpochRng(self.sampler)  # batch_size=None: the sampler gives whole batches (or single samples)
        return rng, DataLoader(dataset, sampler=EpochBatches(self.sampler, rng), batch_size=None, **rest)

    # -- Accelerate's attributes ------------------------------------------------------------
    @property
    def strategy(self):
        if self._strategy is None:
            return current().strategy
        return self._strategy

    @property
    def epoch(self) -> int:
        """torchbay's name for ``iteration``: the epoch the next iteration serves."""
        return self.iteration

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.iteration = value

    @property
    def total_batch_size(self) -> int:
        batch_sampler = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        if getattr(batch_sampler, "split_batches", False):
            return batch_sampler.batch_size
        return batch_sampler.batch_size * getattr(batch_sampler, "num_processes", 1)

    @property
    def total_dataset_length(self) -> int:
        return getattr(self.dataset, "total_length", None) or len(self.dataset)

    def __len__(self) -> int:
        # a strategy whose wrapper (Strategy.wrap_batches) runs the batches differently says how many a loop counts on
        loop_length = getattr(self._batches, "loop_length", None)
        return len(self.base_dataloader) if loop_length is None else loop_length()

    def get_sampler(self) -> Any:
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        """Put ``sampler`` behind this loader's batch sampler (and the one it shards)."""
        if isinstance(self.sampler, BatchSampler):
            self.sampler.sampler = sampler
            return
        self.batch_sampler.sampler = sampler
        if hasattr(self.batch_sampler, "batch_sampler"):
            self.batch_sampler.batch_sampler.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` next and tell the batch sampler, its sampler (or the sharded one's) and the dataset."""
        self.iteration = epoch
        holder = self.batch_sampler
        if hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)
        if hasattr(getattr(holder, "sampler", None), "set_epoch"):
            holder.sampler.set_epoch(epoch)
        inner = getattr(holder, "batch_sampler", None)
        if hasattr(getattr(inner, "sampler", None), "set_epoch"):
            inner.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    # -- one epoch ----------------------------------------------------------------------------
    #: telemetry's ``watch(batches)`` when it is on (set by the Accelerator): it times the waits and counts batches
    _batch_watch = None

    def __iter__(self):
        skip, self._pending_skip = self._pending_skip, 0
        batches = self._iterate(skip + self.skip_batches)
        return batches if self._batch_watch is None else self._batch_watch(batches)

    def _epoch_iterator(self, skip: int):
        """The inner iterator, ``skip`` batches in (skipped by index where there are indices, else read)."""
        if isinstance(self.base_dataloader.batch_sampler, EpochBatches):
            self.base_dataloader.batch_sampler.skip, skip = skip, 0
        elif isinstance(self.base_dataloader.sampler, EpochBatches):
            self.base_dataloader.sampler.skip, skip = skip, 0
        resuming, self._resuming = self._resuming, False
        if resuming:
            # the interrupted run drew the iterator's base seed before it saved, and load_state restored the
            # RNG past that draw: drawing it again would shift the stream
            with torch.random.fork_rng(devices=[]):
                iterator = iter(self._batches)
        else:
            iterator = iter(self._batches)
        for _ in range(skip):
            next(iterator, None)
        return iterator

    def _serve(self, iterator, skipped: int, look_ahead: bool = True):
        """Yield the batches, reading one ahead to flag the last (unless ``iterator`` flags it itself); count the
        epoch when it ends."""
        self.batches_yielded, self.in_epoch = skipped, True
        current = next(iterator, _END)
        while current is not _END:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self._non_blocking)
            if look_ahead:
                upcoming = next(iterator, _END)
                if upcoming is _END:
                    self.end_of_dataloader = True
            self.batches_yielded += 1
            yield current
            current = upcoming if look_ahead else next(iterator, _END)
        self.iteration += 1
        self.in_epoch, self.batches_yielded = False, 0
        self._rng.epoch_start = None

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.iteration, "batches_yielded": self.batches_yielded if self.in_epoch
                                 else 0}
        if self.seed is not None:
            state["seed"] = self.seed
        if self.in_epoch and self._rng.epoch_start:
            state.update(self._rng.epoch_start)
        elif not self.in_epoch:
            state.update(self._rng.state_between_epochs())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["epoch"])
        if state.get("seed") is not None:
            self.seed = int(state["seed"])
            sampler = self._rng.sampler
            if isinstance(sampler, SeedableRandomSampler):
                sampler.seed = self.seed
        self.batches_yielded = int(state.get("batches_yielded", 0))
        self.in_epoch = False
        rng = {k: state[k] for k in ("sampler_seed", "sampler_rng") if k in state}
        if self.batches_yielded:
            self._rng.resume_from, self._resuming = rng, True  # applied where the sampler draws its order
            if self.use_stateful_dataloader:  # the next plain iteration goes on from there
                self._pending_skip = self.batches_yielded
        else:
            self._rng.restore_between_epochs(rng)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_strategy", None)
        state.pop("gradient_state", None)
        state.pop("_batch_watch", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._strategy = None
        self.gradient_state = GradientState()


class DataLoaderShard(PreparedDataLoader):
    """A prepared loader in which every process reads its own share (Accelerate's ``DataLoaderShard``).

    ``rng_types`` (``"generator"``, ``"torch"`` or a device name) are given the main process's state at the start
    of every epoch; ``"generator"`` is ``synchronized_generator`` (the shuffling sampler's).
    """

    def _iterate(self, skip: int):
        if self.rng_types:
            from torchbay.process.seeding import synchronize_rng_states

            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        try:
            self.set_epoch(self.iteration)
            yield from self._serve(self._epoch_iterator(skip), skip)
        finally:
            self._rng.finish()
            self.end()


class SkipDataLoader(PreparedDataLoader):
    """A ``DataLoader`` without its first ``skip_batches`` batches, which are read and dropped (Accelerate's name)."""

    def __init__(self, dataset, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs):
        super().__init__(dataset, skip_batches=skip_batches, use_stateful_dataloader=use_stateful_dataloader,
                         **kwargs)

    def __len__(self) -> int:
        return len(self.base_dataloader) - self.skip_batches

    def __iter__(self):
        self.begin()
        try:
            for index, batch in enumerate(self.base_dataloader):
                if index >= self.skip_batches:
                    yield batch
        finally:
            self.end()


class SkipFirstBatches(DataLoader):
    """One epoch of a prepared loader without its first ``num_batches`` (no data is loaded for them where the
    loader has indices). It is the prepared loader's own epoch: its epoch count and saved position move on, so a
    later plain iteration serves the next epoch. Other attributes are the prepared loader's."""

    def __init__(self, loader: PreparedDataLoader, num_batches: int):  # noqa: D107 (DataLoader.__init__ not called)
        self.__dict__["loader"] = loader
        self.__dict__["num_batches"] = num_batches

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __iter__(self):
        return self.loader._iterate(self.num_batches + self.loader.skip_batches)

    def __getattr__(self, name):
        if name in ("loader", "num_batches"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name, value):
        setattr(self.loader, name, value)

