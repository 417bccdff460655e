"""``dispatch_batches``: the main process reads each global batch and sends every process its slice."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from torchbay.data.sharding import SeedableRandomSampler
from torchbay.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.data.loader import LoaderSettings


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
