"""How a prepared data loader splits its data between processes (Accelerate's ``accelerate.data_loader`` samplers).

- :class:`SeedableRandomSampler`: a random order that depends only on a seed and the epoch;
- :class:`BatchSamplerShard`: each process's batches of a map-style dataset (``split_batches``, ``even_batches``,
  batch samplers whose batches vary in size);
- :class:`IterableDatasetShard`: each process's samples of an iterable dataset;
- :class:`SkipBatchSampler`: a batch sampler without its first batches.

Every rule (which process gets which batch, how the last round is completed) is Accelerate 1.15's, so a run
serves the same samples on torchbay as on Accelerate; tests/data/test_data_accelerate.py compares them.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler

from torchbay.errors import ConfigError


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on its seed and epoch (Accelerate's name and signature).

    The seed is ``data_seed`` (or torchbay's ``seed=``) when given, else ``torch.initial_seed()`` when created; each
    full pass moves to the next epoch. A given ``generator`` is reseeded at every pass.
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


def _split_batches_error(batch_size: Any, num_processes: int) -> ConfigError:
    return ConfigError(f"split_batches needs the batch size ({batch_size}) to be a round multiple of the number of "
                       f"processes ({num_processes}): give the DataLoader (or its batch sampler) such a batch_size, "
                       f"or turn split_batches off")


class BatchSamplerShard(BatchSampler):
    """This process's batches from a batch sampler over the whole dataset.

    Without ``split_batches`` process ``i`` takes batches ``i``, ``i + n``, ... ; with it, every batch is cut into
    ``n`` slices. With ``even_batches`` the last round is completed with samples (or, for batch samplers whose
    batches vary in size, whole batches) from the start of the epoch, so every process serves as many batches;
    ``drop_last`` drops the incomplete round instead.
    """

    def __init__(self, batch_sampler: Any, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes):
            raise _split_batches_error(self.batch_size, num_processes)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    @property
    def per_process_batch_size(self) -> int | None:
        if self.batch_size is None:
            return None
        return self.batch_size // self.num_processes if self.split_batches else self.batch_size

    def __len__(self) -> int:
        total, n = len(self.batch_sampler), self.num_processes
        if self.split_batches or total % n == 0:
            return total if self.split_batches else total // n
        if self.drop_last:
            return total // n
        if self.even_batches:
            return total // n + 1
        return total // n + int(self.process_index < total % n)

    def __iter__(self) -> Iterator[list[int]]:
        return self._sliced() if self.split_batches else self._round_robin()

    def _full(self, batch: list[int]) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    def _sliced(self) -> Iterator[list[int]]:
        """``split_batches``: every process takes its slice of each full batch; the last one is completed."""
        width = self.batch_size // self.num_processes
        start, end = width * self.process_index, width * (self.process_index + 1)
        first: list[int] | None = None
        batch: list[int] = []
        for batch in self.batch_sampler:
            first = list(batch) if first is None else first
            if len(batch) == self.batch_size:
                yield batch[start:end]
        if self.drop_last or first is None or len(batch) == self.batch_size:
            return
        if not self.even_batches:
            if len(batch) > start:
                yield batch[start:end]
            return
        while len(first) < self.batch_size:  # a dataset smaller than one batch: repeat it
            first = first + first
        yield (list(batch) + first)[start:end]

    def _round_robin(self) -> Iterator[list[int]]:
        """Batch ``k`` goes to process ``k % n``; a round is served once its last batch is known to be full."""
        n, me = self.num_processes, self.process_index
        start: list[Any] = []  # the first round: whole batches (varying sizes) or their indices (fixed size)
        mine: list[int] | None = None
        count, batch = 0, []
        for count, batch in enumerate(self.batch_sampler, start=1):
            if not self.drop_last and count <= n:
                start.append(batch) if self.batch_size is None else start.extend(batch)
            if (count - 1) % n == me:
                mine = batch
            if count % n == 0 and self._full(batch):
                yield mine
                mine = None
        if self.drop_last or not start:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if mine and self._full(mine):
            yield mine
        yield from self._completed_round(start, count, batch)

    def _completed_round(self, start: list[Any], count: int, last: list[int]) -> Iterator[list[int]]:
        """The batches that complete the last round, cycling through ``start``; this process's one, if any."""
        n, me = self.num_processes, self.process_index
        needed = n if self.batch_size is None else n * self.batch_size
        while len(start) < needed:  # fewer samples than one round: repeat them
            start = start + start
        position, partial = (count, []) if self._full(last) else (count - 1, list(last))
        cursor = 0
        while position % n or partial:
            if self.batch_size is None:
                made, cursor = start[cursor], cursor + 1
            else:
                taken = self.batch_size - len(partial)
                made, cursor = partial + start[cursor:cursor + taken], cursor + taken
            if position % n == me:
                yield made
            partial, position = [], position + 1


class IterableDatasetShard(IterableDataset):
    """This process's samples of an iterable dataset (Accelerate's name and signature).

    Samples are read in rounds of ``batch_size * num_processes`` (``batch_size`` with ``split_batches``) and every
    process keeps its slice; the last round is completed from the first one, or dropped with ``drop_last``.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False):
        if split_batches and batch_size > 1 and batch_size % num_processes:
            raise _split_batches_error(batch_size, num_processes)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        rounds = len(self.dataset) / (self.batch_size * self.num_processes)
        return (math.floor(rounds) if self.drop_last else math.ceil(rounds)) * self.batch_size

    def __iter__(self):
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        round_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        width = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        mine = slice(self.process_index * width, (self.process_index + 1) * width)
        first: list[Any] | None = None
        current: list[Any] = []
        for sample in self.dataset:
            current.append(sample)
            if len(current) == round_size:
                yield from current[mine]
                first = current if first is None else first
                current = []
        if self.drop_last or not current:
            return
        first = list(current) if first is None else first
        while len(current) < round_size:
            current = current + first
        yield from current[mine]


class SkipBatchSampler(BatchSampler):
    """A batch sampler without the first ``skip_batches`` batches of another one (Accelerate's name)."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0):
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __iter__(self):
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip_batches


#: torchbay's earlier names
ShardedBatchSampler = BatchSamplerShard
