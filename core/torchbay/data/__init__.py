"""Prepared data loaders (Accelerate's ``accelerate.data_loader`` names): ``loader`` (the prepared loaders),
``dispatch`` (one process reads, all get a slice), ``prepare`` (``prepare_data_loader``, ``skip_first_batches``),
``sharding`` (samplers), ``epoch`` (per-epoch state), ``operations`` (nested-structure helpers: send_to_device,
gather, pad...).
"""

from torchbay._lazy import serve_names

__all__ = ['prepare_data_loader', 'skip_first_batches', 'get_sampler', 'PreparedDataLoader', 'DataLoaderShard',
           'DataLoaderDispatcher', 'DataLoaderStateMixin', 'SkipDataLoader', 'SkipFirstBatches', 'BatchSamplerShard',
           'IterableDatasetShard', 'SkipBatchSampler', 'SeedableRandomSampler']
_SOURCES = {
    "torchbay.data.prepare": ["prepare_data_loader", "skip_first_batches"],
    "torchbay.data.dispatch": ["DataLoaderDispatcher"],
    "torchbay.data.epoch": ["DataLoaderStateMixin"],
    "torchbay.data.loader": ["get_sampler", "PreparedDataLoader", "DataLoaderShard", "SkipDataLoader",
                             "SkipFirstBatches"],
    "torchbay.data.sharding": ["BatchSamplerShard", "IterableDatasetShard", "SkipBatchSampler",
                               "SeedableRandomSampler"],
}
__getattr__, __dir__ = serve_names(__name__, _SOURCES, fallback=("torchbay.data.loader",))
