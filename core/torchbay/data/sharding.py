"""How a prepared data loader splits its data between processes.

- :class:`SeedableRandomSampler`: a random order every process agrees on, reseeded per epoch;
- :class:`ShardedBatchSampler` / :class:`BatchSamplerShard`: each process's batches of a
  map-style dataset (``split_batches``, ``even_batches``);
- :class:`IterableShard`: each process's items of an iterable dataset.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler

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
        if width == 1:  # a short last batch is the only one with fewer real samples than a full one
            for batch in self.batch_sampler:
                self.last_real_samples = len(batch) if self.batch_size and len(batch) < self.batch_size else None
                yield batch
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
