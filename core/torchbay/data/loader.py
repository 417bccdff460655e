"""Prepared data loaders: sharding across processes, per-epoch reseeding, exact resume.

Semantics follow Accelerate's documentation of ``split_batches``, ``even_batches`` and
``dispatch_batches``. A prepared loader counts its own epochs (no ``set_epoch`` calls) and
saves that count and its position in ``save_state``, so ``load_state`` followed by
``skip_first_batches`` serves exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from torchbay.data.dispatch import BatchDispatcher
from torchbay.data.gradient_state import GradientState
from torchbay.data.sharding import BatchSamplerShard, IterableShard, SeedableRandomSampler, ShardedBatchSampler  # noqa: F401 (Accelerate's names)
from torchbay.errors import ConfigError
from torchbay.process.state import PartialState


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
    if slice_fn_for_dispatch is not None:
        raise ConfigError("prepare_data_loader: slice_fn_for_dispatch is not supported by torchbay (dispatched batches "
                          "are sliced along dim 0); leave it unset")
    state = PartialState()
    strategy = state._strategy
    dp_size, dp_rank = strategy.data_parallel_size, strategy.data_parallel_rank
    if torch_device_mesh is not None:  # ranks that differ only in tp/cp read the same batch
        names = torch_device_mesh.mesh_dim_names or ()
        dp_dims = [n for n in ("dp_replicate", "dp_shard") if n in names]
        dp_size, dp_rank = 1, 0
        for name in dp_dims:
            dp_size_here = torch_device_mesh[name].size()
            dp_rank = dp_rank * dp_size_here + torch_device_mesh.get_local_rank(name)
            dp_size *= dp_size_here
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ConfigError("prepare_data_loader(dispatch_batches=True) needs put_on_device=True")
    seed = data_seed if data_seed is not None else strategy.broadcast_object(torch.initial_seed() % 2**62)
    settings = LoaderSettings(num_processes=dp_size if num_processes is None else num_processes,
                              process_index=dp_rank if process_index is None else process_index,
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
