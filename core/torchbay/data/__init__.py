"""Prepared data loaders (Accelerate's ``accelerate.data_loader`` path): ``loader`` (the prepared loaders),
``dispatch`` (one process reads, all get a slice), ``prepare`` (``prepare_data_loader``, ``skip_first_batches``),
``sharding`` (samplers), ``epoch`` (per-epoch state), ``operations`` (nested-structure helpers: send_to_device,
gather, pad...).
"""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "prepare_data_loader": "torchbay.data.prepare",
    "skip_first_batches": "torchbay.data.prepare",
    "DataLoaderDispatcher": "torchbay.data.dispatch",
    "DataLoaderStateMixin": "torchbay.data.epoch",
    "get_sampler": "torchbay.data.loader",
    "PreparedDataLoader": "torchbay.data.loader",
    "DataLoaderShard": "torchbay.data.loader",
    "SkipDataLoader": "torchbay.data.loader",
    "SkipFirstBatches": "torchbay.data.loader",
    "BatchSamplerShard": "torchbay.data.sharding",
    "IterableDatasetShard": "torchbay.data.sharding",
    "SkipBatchSampler": "torchbay.data.sharding",
    "SeedableRandomSampler": "torchbay.data.sharding",
    # what accelerate.data_loader also offers (it answers for that module)
    "GradientState": "torchbay.data.gradient_state",
    "send_to_device": "torchbay.data.operations",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["BatchSamplerShard", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin", "GradientState",
           "IterableDatasetShard", "PreparedDataLoader", "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader",
           "SkipFirstBatches", "get_sampler", "prepare_data_loader", "send_to_device", "skip_first_batches"]

if TYPE_CHECKING:
    from torchbay.data.dispatch import DataLoaderDispatcher
    from torchbay.data.epoch import DataLoaderStateMixin
    from torchbay.data.gradient_state import GradientState
    from torchbay.data.loader import DataLoaderShard, PreparedDataLoader, SkipDataLoader, SkipFirstBatches, get_sampler
    from torchbay.data.operations import send_to_device
    from torchbay.data.prepare import prepare_data_loader, skip_first_batches
    from torchbay.data.sharding import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler
# -- end of the names written by scripts/public_names.py --
