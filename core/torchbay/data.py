"""Prepared data loaders: sharding across processes, per-epoch reseeding, exact resume.

Semantics follow Accelerate's documentation of ``split_batches``, ``even_batches`` and
``dispatch_batches``. A prepared loader counts its own epochs (no ``set_epoch`` calls) and
saves that count and its position in ``save_state``, so ``load_state`` followed by
``skip_first_batches`` serves exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from torchbay.errors import ConfigError


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on its seed and epoch (Accelerate's name and signature).

    The seed is ``data_seed`` (or torchbay's ``seed=``) when given, else ``torch.initial_seed()``
    when created; each full pass moves to the next epoch, as Accelerate's does.
    """

    def __init__(self, data_source=None, replacement: bool = False, num_samples: int | None = None,
                 generator: torch.Generator | None = None, *, data_seed: int | None = None, seed: int | None = None):
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        chosen = seed if seed is not None else data_seed
        self.initial_seed = int(chosen) if chosen is not None else torch.initial_seed()
        self.epoch = 0

    @property
    def seed(self) -> int:
        return self.initial_seed

    @seed.setter
    def seed(self, value: int) -> None:
        self.initial_seed = int(value)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


class ShardedBatchSampler:
    """Yields this process's batches of index lists, from a batch sampler over the dataset.

    Without ``split_batches`` each process takes every ``num_processes``-th batch; with it,
    each global batch is cut into ``num_processes`` slices. With ``even_batches`` the last
    round is completed with indices from the start of the epoch, so every process gets the
    same number of equally sized batches; :attr:`last_real_samples` then tells how many of
    the last round's samples are real (``gather_for_metrics`` drops the rest).
    """

    def __init__(self, batch_sampler: BatchSampler, num_processes: int, process_index: int,
                 split_batches: bool, even_batches: bool):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        self.skip = 0
        self.on_start = None  # called where the wrapped sampler starts drawing (the loader's RNG bookkeeping)
        self.last_real_samples: int | None = None
        if split_batches and self.batch_size and self.batch_size % num_processes:
            raise ConfigError(f"dataloader.split_batches needs the batch size ({self.batch_size}) to be a "
                              f"multiple of the number of processes ({num_processes}); change one of them")

    @property
    def per_process_batch_size(self) -> int:
        return self.batch_size // self.num_processes if self.split_batches else self.batch_size

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if self.split_batches or self.num_processes == 1:
            return n
        if self.drop_last:
            return n // self.num_processes
        return math.ceil(n / self.num_processes) if self.even_batches else (
            n // self.num_processes + int(self.process_index < n % self.num_processes))

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        if self.on_start is not None:
            self.on_start()
        for i, batch in enumerate(self._batches()):
            if i >= skip:
                yield batch

    def _batches(self) -> Iterator[list[int]]:
        self.last_real_samples = None
        width = self.num_processes
        if width == 1:
            yield from self.batch_sampler
            return
        rounds = self._rounds()
        first: list[int] = []
        for group in rounds:
            if len(first) < self.batch_size * width:
                first.extend(i for b in group for i in b)
            complete = len(group) == (1 if self.split_batches else width) and len(group[-1]) == self.batch_size
            if complete:
                yield self._slice(group)
                continue
            flat = [i for b in group for i in b]
            self.last_real_samples = len(flat)
            if self.even_batches:
                needed = self.batch_size * (1 if self.split_batches else width) - len(flat)
                flat += list(itertools.islice(itertools.cycle(first), needed))
                size = self.per_process_batch_size
                yield flat[self.process_index * size:(self.process_index + 1) * size]
            else:
                size = math.ceil(len(flat) / width) if self.split_batches else self.batch_size
                part = flat[self.process_index * size:(self.process_index + 1) * size]
                if part:
                    yield part

    def _rounds(self) -> Iterator[list[list[int]]]:
        if self.split_batches:
            for batch in self.batch_sampler:
                yield [list(batch)]
            return
        group: list[list[int]] = []
        for batch in self.batch_sampler:
            group.append(list(batch))
            if len(group) == self.num_processes:
                yield group
                group = []
        if group and not self.drop_last:
            yield group

    def _slice(self, group: list[list[int]]) -> list[int]:
        if self.split_batches:
            size = self.per_process_batch_size
            return group[0][self.process_index * size:(self.process_index + 1) * size]
        return group[self.process_index]


class BatchSamplerShard(ShardedBatchSampler):
    """Accelerate's name and defaults for :class:`ShardedBatchSampler`."""

    def __init__(self, batch_sampler: BatchSampler, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True):
        super().__init__(batch_sampler, num_processes, process_index, split_batches, even_batches)


class IterableShard(IterableDataset):
    """Each process keeps its slice of every ``batch_size * num_processes`` samples."""

    def __init__(self, dataset, batch_size: int, num_processes: int, process_index: int, split_batches: bool):
        self.dataset = dataset
        self.chunk = batch_size if split_batches else batch_size * num_processes
        self.size = self.chunk // num_processes
        self.process_index = process_index

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self):
        buffer: list[Any] = []
        first: list[Any] = []
        for sample in self.dataset:
            buffer.append(sample)
            if len(first) < self.chunk:
                first.append(sample)
            if len(buffer) == self.chunk:
                yield from buffer[self.process_index * self.size:(self.process_index + 1) * self.size]
                buffer = []
        if buffer:  # complete the last round from the start, as even_batches does
            buffer += list(itertools.islice(itertools.cycle(first), self.chunk - len(buffer)))
            yield from buffer[self.process_index * self.size:(self.process_index + 1) * self.size]


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)({k: move_to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device, non_blocking) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                "multiprocessing_context", "prefetch_factor", "persistent_workers", "pin_memory_device")


@dataclass
class LoaderSettings:
    """How a prepared loader shards and places batches (the ``dataloader`` config section, per loader)."""

    num_processes: int = 1
    process_index: int = 0
    device: Any = None  # None: batches stay where the loader puts them
    split_batches: bool = False
    even_batches: bool = True
    dispatch_batches: bool | None = None
    use_seedable_sampler: bool = False
    non_blocking: bool = False
    #: after load_state / load_state_dict, iterating goes on from the saved position (as
    #: torchdata's StatefulDataLoader); otherwise use skip_first_batches
    use_stateful_dataloader: bool = False


class PreparedDataLoader:
    """What ``Accelerator.prepare`` returns for a ``DataLoader``.

    Iterating it starts a new epoch, moves batches to the device, and tells the gradient
    state when the last batch comes. Shuffling is the user's: the loader's generator and
    sampler are kept, so one process serves exactly what the unprepared loader would; with
    several processes the sampler's generator is made common to all (seeded from ``seed``
    when it had none, then synchronised from process 0 each epoch). The generator state at
    the start of an epoch is saved, so a resumed run serves the same batches.
    ``use_seedable_sampler`` replaces a ``RandomSampler`` by a :class:`SeedableRandomSampler`
    (order from ``seed + epoch``).
    """

    def __init__(self, dataloader: DataLoader, *, settings: LoaderSettings, seed: int, strategy, gradient_state,
                 device_backend=None):
        self.original = dataloader
        self.settings = settings
        self.strategy = strategy
        self.gradient_state = gradient_state
        num, index = settings.num_processes, settings.process_index
        self.seed = seed
        self.epoch = 0  # the epoch the next iteration serves
        self.batches_yielded = 0
        self.in_epoch = False
        self.device = settings.device
        self.non_blocking = settings.non_blocking
        self.batch_sampler: ShardedBatchSampler | None = None
        self._end_of_dataloader, self._remainder = False, -1  # read through the gradient state
        self._pending_skip = 0  # batches the next iteration skips (a stateful loader's restored position)
        self._epoch_start: dict[str, Any] | None = None  # sampler RNG at the start of the current epoch
        self._resume_from: dict[str, Any] | None = None
        kwargs = {k: getattr(dataloader, k) for k in _LOADER_ARGS if hasattr(dataloader, k)}
        if dataloader.num_workers == 0:
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        kwargs["generator"] = dataloader.generator  # base seeds drawn as the unprepared loader draws them
        dataset = dataloader.dataset
        self.dispatcher: BatchDispatcher | None = None
        dispatch = settings.dispatch_batches
        if dispatch and num > 1:
            kwargs["generator"] = torch.Generator().manual_seed(seed)
            self.dispatcher = BatchDispatcher(dataloader, settings, strategy, kwargs, seed)
            self.sampler, self.loader = self.dispatcher.sampler, self.dispatcher
        elif isinstance(dataset, IterableDataset):
            batch_size = dataloader.batch_size
            if num > 1:
                dataset = IterableShard(dataset, batch_size, num, index, settings.split_batches)
                batch_size = batch_size // num if settings.split_batches else batch_size
            self.sampler = dataset
            self.loader = DataLoader(dataset, batch_size=batch_size, drop_last=dataloader.drop_last, **kwargs)
        else:
            sampler_is_batch_sampler = dataloader.batch_size is None and isinstance(dataloader.sampler, BatchSampler)
            if dataloader.batch_sampler is None and not sampler_is_batch_sampler:
                raise ConfigError("a DataLoader with batch_size=None can be prepared when its sampler is a "
                                  "BatchSampler (DataLoader(ds, sampler=BatchSampler(...), batch_size=None)); give "
                                  "the DataLoader a batch_size or a batch_sampler")
            inner = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
            sampler = inner.sampler if hasattr(inner, "sampler") else dataloader.sampler
            if (settings.use_seedable_sampler and isinstance(sampler, RandomSampler)
                    and not isinstance(sampler, SeedableRandomSampler)):
                sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                                num_samples=sampler._num_samples, seed=seed)
                inner = BatchSampler(sampler, inner.batch_size, inner.drop_last)
            self.sampler = sampler
            self.batch_sampler = ShardedBatchSampler(inner, num, index, settings.split_batches, settings.even_batches)
            self.batch_sampler.on_start = self._start_sampling
            if sampler_is_batch_sampler:
                self.loader = DataLoader(dataset, sampler=self.batch_sampler, batch_size=None, **kwargs)
            else:
                self.loader = DataLoader(dataset, batch_sampler=self.batch_sampler, **kwargs)
        if device_backend is not None:
            self.loader = device_backend.wrap_dataloader(self.loader)

    def _start_sampling(self) -> None:
        """Runs where the unprepared sampler would draw its order: record (or, resuming, restore) its RNG."""
        sampler = self.sampler
        if isinstance(sampler, SeedableRandomSampler) or not isinstance(sampler, RandomSampler):
            return
        resume, self._resume_from = self._resume_from, None
        if sampler.generator is None:  # no generator: draw the seed RandomSampler would draw, here
            if resume and "sampler_seed" in resume:  # drawn before the save: the restored RNG is past it
                seed = resume["sampler_seed"]
            else:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            if not resume and self.settings.num_processes > 1:
                seed = self.strategy.broadcast_object(seed)  # every process shuffles as process 0 does
            self._epoch_start = {"sampler_seed": seed}
            self._drawn_generator = torch.Generator().manual_seed(seed)
            sampler.generator = self._drawn_generator
            return
        if resume and "sampler_rng" in resume:
            sampler.generator.set_state(resume["sampler_rng"])
        elif self.settings.num_processes > 1:
            sampler.generator.set_state(self.strategy.broadcast_object(sampler.generator.get_state()))
        self._epoch_start = {"sampler_rng": sampler.generator.get_state()}

    def _end_sampling(self) -> None:
        if getattr(self, "_drawn_generator", None) is not None and self.sampler.generator is self._drawn_generator:
            self.sampler.generator = None  # draw from the global RNG again next epoch, as unprepared
        self._drawn_generator = None

    @property
    def dataset(self):
        return self.original.dataset

    @property
    def batch_size(self):
        return self.original.batch_size

    @property
    def total_batch_size(self) -> int:
        if self.dispatcher is not None:
            return self.dispatcher.global_batch_size
        if self.batch_sampler is None:
            return self.original.batch_size * (1 if self.settings.split_batches else self.settings.num_processes)
        per = self.batch_sampler.per_process_batch_size
        return per * self.settings.num_processes

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` next (optional: the loader counts epochs by itself)."""
        self.epoch = epoch

    def __iter__(self):
        skip, self._pending_skip = self._pending_skip, 0
        return self._iterate(skip=skip)

    def _iterate(self, skip: int):
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        if self.batch_sampler is not None:
            self.batch_sampler.skip = skip
        self.batches_yielded, self.in_epoch = skip, True
        state = self.gradient_state
        state.begin_dataloader(self)
        try:
            if self._resume_from is not None:
                # resuming: the interrupted run drew the iterator's base seed before it saved, and
                # load_state restored the RNG past that draw; drawing it again would shift the stream
                with torch.random.fork_rng(devices=[]):
                    iterator = iter(self.loader)
            else:
                iterator = iter(self.loader)
            if self.batch_sampler is None:  # iterable or dispatched: skip by reading
                for _ in range(skip):
                    next(iterator, None)
            current = next(iterator, _END)
            while current is not _END:
                upcoming = next(iterator, _END)
                if upcoming is _END:
                    self._end_of_dataloader = True
                    self._remainder = self._remainder_now()
                self.batches_yielded += 1
                yield current if self.device is None else move_to_device(current, self.device, self.non_blocking)
                current = upcoming
            self.epoch += 1
            self.in_epoch = False
            self.batches_yielded = 0
            self._epoch_start = None
        finally:
            self._end_sampling()
            state.end_dataloader(self)

    def _remainder_now(self) -> int:
        if self.dispatcher is not None:
            return self.dispatcher.last_real_samples
        if self.batch_sampler is None or self.batch_sampler.last_real_samples is None:
            return -1
        return self.batch_sampler.last_real_samples

    # -- resume -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batches_yielded": self.batches_yielded if self.in_epoch else 0,
                                 "seed": self.seed}
        if self.in_epoch and self._epoch_start:
            state.update(self._epoch_start)
        elif not self.in_epoch and getattr(self.sampler, "generator", None) is not None and \
                not isinstance(self.sampler, SeedableRandomSampler):
            state["sampler_rng"] = self.sampler.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        if isinstance(self.sampler, SeedableRandomSampler):
            self.sampler.seed = self.seed
        self.batches_yielded = int(state.get("batches_yielded", 0))
        self.in_epoch = False
        rng = {k: state[k] for k in ("sampler_seed", "sampler_rng") if k in state}
        if self.batches_yielded:
            self._resume_from = rng  # applied where the sampler draws its order
            if self.settings.use_stateful_dataloader:  # the next plain iteration goes on from there
                self._pending_skip = self.batches_yielded
        elif "sampler_rng" in rng and getattr(self.sampler, "generator", None) is not None:
            self.sampler.generator.set_state(rng["sampler_rng"])


class DataLoaderShard(PreparedDataLoader):
    """A prepared loader in which every process reads its own share (Accelerate's class name)."""


class DataLoaderDispatcher(PreparedDataLoader):
    """A prepared loader whose batches the main process reads and sends out (``dispatch_batches``)."""


class BatchDispatcher:
    """``dispatch_batches``: the main process loads each global batch and sends every
    process its slice (for datasets that only one process should read)."""

    def __init__(self, dataloader: DataLoader, cfg: LoaderSettings, strategy, kwargs: dict, seed: int):
        self.strategy = strategy
        self.num, self.index = cfg.num_processes, cfg.process_index
        self.even = cfg.even_batches
        per = dataloader.batch_size
        self.global_batch_size = per if cfg.split_batches else per * self.num
        if self.global_batch_size % self.num:
            raise ConfigError(f"dataloader.dispatch_batches with split_batches needs the batch size ({per}) to be a "
                              f"multiple of the number of processes ({self.num})")
        self.per_process = self.global_batch_size // self.num
        self.last_real_samples = -1
        dataset = dataloader.dataset
        sampler = None
        if not isinstance(dataset, IterableDataset):
            sampler = dataloader.sampler
            if cfg.use_seedable_sampler and isinstance(sampler, RandomSampler):
                sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                                num_samples=sampler._num_samples, seed=seed)
        self.sampler = sampler if sampler is not None else dataset
        self.loader = None
        if self.index == 0:
            self.loader = DataLoader(dataset, batch_size=self.global_batch_size, sampler=sampler,
                                     drop_last=dataloader.drop_last, **kwargs)
        self.length = self.strategy.broadcast_object(len(self.loader) if self.loader is not None and
                                                     hasattr(dataset, "__len__") else 0)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        source = iter(self.loader) if self.loader is not None else None
        first = None
        while True:
            batch = next(source, None) if source is not None else None
            if self.index == 0 and batch is not None:
                first = batch if first is None else first
                real = _batch_len(batch)
                if real < self.global_batch_size and self.even:
                    batch = _concat(batch, first, self.global_batch_size - real)
            else:
                real = 0
            batch, real = self.strategy.broadcast_object((batch, real))
            if batch is None:
                return
            self.last_real_samples = real if real < self.global_batch_size else -1
            size = self.per_process if self.even or real == self.global_batch_size else -(-real // self.num)
            yield _slice(batch, self.index * size, (self.index + 1) * size)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    return _batch_len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)


def _slice(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end]
    if isinstance(batch, dict):
        return type(batch)({k: _slice(v, start, end) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, start, end) for v in batch)
    return batch


def _concat(batch: Any, first: Any, count: int) -> Any:
    """``batch`` followed by ``count`` samples cycled from ``first`` (even_batches padding)."""
    if isinstance(batch, torch.Tensor):
        reps = -(-count // first.shape[0])
        return torch.cat([batch, first.repeat(reps, *[1] * (first.ndim - 1))[:count]])
    if isinstance(batch, dict):
        return type(batch)({k: _concat(v, first[k], count) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_concat(v, f, count) for v, f in zip(batch, first))
    return batch


class SkipFirstBatches:
    """One epoch of a prepared loader without its first ``num_batches`` (no data is loaded for them)."""

    def __init__(self, loader: PreparedDataLoader, num_batches: int):
        self.loader = loader
        self.num_batches = num_batches

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __iter__(self):
        if self.loader.batch_sampler is None:  # iterable or dispatched: skip by reading
            it = self.loader._iterate(skip=0)
            for _ in range(self.num_batches):
                next(it, None)
            return it
        return self.loader._iterate(skip=self.num_batches)

    def __getattr__(self, name):
        return getattr(self.loader, name)


_END = object()


def prepare_data_loader(dataloader: DataLoader, device: Any = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: Any = None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> PreparedDataLoader:
    """Accelerate's free function: shard ``dataloader`` for this process without an ``Accelerator``.

    Uses the process state (``PartialState``) for the defaults and the collectives. ``rng_types``
    is accepted for compatibility: the sampler's generator is always synchronised across processes.
    """
    from torchbay.state import PartialState
    from torchbay.wrappers import GradientState

    refused = {"slice_fn_for_dispatch": slice_fn_for_dispatch, "torch_device_mesh": torch_device_mesh}
    given = [name for name, value in refused.items() if value]
    if given:
        raise ConfigError(f"prepare_data_loader: {', '.join(given)} not supported by torchbay (dispatched batches are "
                          f"sliced along dim 0; N-D meshes belong to the strategy plugins); leave it unset")
    state = PartialState()
    strategy = state._strategy
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ConfigError("prepare_data_loader(dispatch_batches=True) needs put_on_device=True")
    seed = data_seed if data_seed is not None else strategy.broadcast_object(torch.initial_seed() % 2**62)
    settings = LoaderSettings(num_processes=state.num_processes if num_processes is None else num_processes,
                              process_index=state.process_index if process_index is None else process_index,
                              device=(device if device is not None else state.device) if put_on_device else None,
                              split_batches=split_batches, even_batches=even_batches,
                              dispatch_batches=dispatch_batches, use_seedable_sampler=use_seedable_sampler,
                              non_blocking=non_blocking, use_stateful_dataloader=use_stateful_dataloader)
    gradient_state = state.__dict__.get("_gradient_state") or GradientState(1)
    cls = DataLoaderDispatcher if dispatch_batches else DataLoaderShard
    return cls(dataloader, settings=settings, seed=seed, strategy=strategy, gradient_state=gradient_state,
               device_backend=strategy.device_backend)


def skip_first_batches(dataloader: PreparedDataLoader, num_batches: int = 0) -> SkipFirstBatches:
    """One epoch of a prepared loader without its first ``num_batches`` (Accelerate's free function)."""
    if not isinstance(dataloader, PreparedDataLoader):
        raise ConfigError("skip_first_batches takes a data loader returned by prepare or prepare_data_loader")
    return SkipFirstBatches(dataloader, num_batches)
