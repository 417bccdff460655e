"""``prepare_data_loader`` and ``skip_first_batches`` (Accelerate's free functions, ``accelerate.data_loader``).

The shuffling follows Accelerate 1.15 at the same seed: with one process the loader's own order; with several, a
``RandomSampler`` without a generator gets one at prepare (seeded by a draw from the global RNG, as Accelerate
draws it) and its state is sent from the main process at the start of every epoch (``rng_types=["generator"]``,
the Accelerator's default); ``use_seedable_sampler`` puts a :class:`SeedableRandomSampler` (order from
``data_seed`` + epoch) behind the batch sampler.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from torchbay.data.dispatch import DataLoaderDispatcher
from torchbay.data.loader import DataLoaderShard, PreparedDataLoader, SkipDataLoader, SkipFirstBatches, get_sampler
from torchbay.data.sharding import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler
from torchbay.errors import ConfigError
from torchbay.process.current import current

#: DataLoader arguments a prepared loader takes over from the user's loader
_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def _loader_args(dataloader: DataLoader) -> dict[str, Any]:
    args = {k: getattr(dataloader, k) for k in _LOADER_ARGS if hasattr(dataloader, k)}
    if not args.get("num_workers"):
        args.pop("prefetch_factor", None)
        args.pop("persistent_workers", None)
    return args


def _check_split(dataloader: DataLoader, num_processes: int) -> None:
    size = dataloader.batch_size if dataloader.batch_size is not None else \
        getattr(dataloader.batch_sampler, "batch_size", None)
    if size is None:
        raise ConfigError("split_batches needs a batch size: give the DataLoader a batch_size, or its batch_sampler "
                          "a batch_size attribute (or turn split_batches off)")
    if size > 1 and size % num_processes:
        raise ConfigError(f"split_batches needs the batch size ({size}) to be a round multiple of the number of "
                          f"processes ({num_processes}); change one of them, or turn split_batches off")


def _data_parallel(num_processes: int, process_index: int, mesh: Any) -> tuple[int, int]:
    """Ranks that differ only in tensor/context parallelism read the same batches."""
    names = mesh.mesh_dim_names or ()
    dims = [n for n in ("dp_replicate", "dp_shard") if n in names]
    if not dims:
        return num_processes, process_index
    size, rank = 1, 0
    for name in dims:
        here = mesh[name].size()
        rank, size = rank * here + mesh.get_local_rank(name), size * here
    return size, rank


def prepare_data_loader(dataloader: DataLoader, device: Any = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: Any = None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> PreparedDataLoader:
    """This process's share of ``dataloader`` (Accelerate's free function; the process state gives the defaults)."""
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ConfigError("prepare_data_loader(dispatch_batches=True) needs put_on_device=True")
    strategy = current().strategy
    num_processes = strategy.data_parallel_size if num_processes is None else num_processes
    process_index = strategy.data_parallel_rank if process_index is None else process_index
    if torch_device_mesh is not None:
        num_processes, process_index = _data_parallel(num_processes, process_index, torch_device_mesh)
    if split_batches:
        _check_split(dataloader, num_processes)
    dataset = dataloader.dataset
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    batch_sampler = None if isinstance(dataset, IterableDataset) else \
        dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
    synchronized_generator = None
    sampler = get_sampler(dataloader)
    seed = data_seed if data_seed is not None else strategy.broadcast_object(torch.initial_seed())
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                        num_samples=sampler._num_samples, generator=sampler.generator, seed=seed)
    if num_processes != 1 and not dispatch_batches:
        if isinstance(dataset, IterableDataset) and not split_batches and \
                getattr(dataset, "n_shards", 0) >= num_processes and hasattr(dataset, "shard"):
            dataset = dataset.shard(num_shards=num_processes, index=process_index)  # 🤗 datasets' own sharding
        elif isinstance(dataset, IterableDataset):
            synchronized_generator = getattr(dataset, "generator", None)
            dataset = IterableDatasetShard(dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last,
                                           num_processes=num_processes, process_index=process_index,
                                           split_batches=split_batches)
        else:
            if not use_seedable_sampler and hasattr(sampler, "generator"):
                if sampler.generator is None:  # drawn here, from the global RNG, as Accelerate draws it
                    seed_now = int(torch.empty((), dtype=torch.int64).random_().item())
                    sampler.generator = torch.Generator().manual_seed(seed_now)
                synchronized_generator = sampler.generator
            batch_sampler = BatchSamplerShard(batch_sampler, num_processes=num_processes,
                                              process_index=process_index, split_batches=split_batches,
                                              even_batches=even_batches)
    if rng_types is not None:
        rng_types = [r for r in rng_types if synchronized_generator is not None or
                     str(getattr(r, "value", r)) != "generator"]
    kwargs = _loader_args(dataloader)
    if batch_sampler is None:  # an iterable dataset: batched by the inner loader
        kwargs["drop_last"] = dataloader.drop_last
        kwargs["batch_size"] = (dataloader.batch_size // num_processes if split_batches and not dispatch_batches
                                else dataloader.batch_size)
    common = dict(use_stateful_dataloader=use_stateful_dataloader, _drop_last=dataloader.drop_last,
                  _non_blocking=non_blocking, torch_device_mesh=torch_device_mesh)
    if dispatch_batches:
        kwargs.pop("generator", None)
        loader = DataLoaderDispatcher(dataset, split_batches=split_batches, batch_sampler=batch_sampler,
                                      slice_fn=slice_fn_for_dispatch, **common, **kwargs)
        loader.num_processes, loader.process_index = num_processes, process_index
    else:
        placed = device if put_on_device else None
        index_args = ({"sampler": batch_sampler, "batch_size": dataloader.batch_size} if sampler_is_batch_sampler
                      else {"batch_sampler": batch_sampler})
        loader = DataLoaderShard(dataset, device=placed, rng_types=rng_types,
                                 synchronized_generator=synchronized_generator, **index_args, **common, **kwargs)
    if isinstance(sampler, SeedableRandomSampler) and use_seedable_sampler:
        loader.set_sampler(sampler)
    loader.seed = seed
    loader._strategy = strategy
    return loader


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """``dataloader`` without its first ``num_batches`` batches, for one epoch.

    A prepared loader gives a view of its own next epoch (its epoch count moves on, see :class:`SkipFirstBatches`);
    a plain ``DataLoader`` gives a new loader that skips them by index (by reading, for an iterable dataset).
    """
    if isinstance(dataloader, SkipFirstBatches):
        dataloader = dataloader.loader
    if isinstance(dataloader, PreparedDataLoader):
        return SkipFirstBatches(dataloader, num_batches)
    kwargs = _loader_args(dataloader)
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        return SkipDataLoader(dataset, skip_batches=num_batches, batch_size=dataloader.batch_size,
                              drop_last=dataloader.drop_last, **kwargs)
    if isinstance(dataloader.sampler, BatchSampler):
        return DataLoader(dataset, sampler=SkipBatchSampler(dataloader.sampler, num_batches), batch_size=None,
                          **kwargs)
    return DataLoader(dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches), **kwargs)

