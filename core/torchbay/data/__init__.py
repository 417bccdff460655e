"""Prepared data loaders (Accelerate's ``accelerate.data_loader`` names): ``loader`` (sharding per process,
skipping, ``prepare_data_loader``), ``dispatch`` (one process reads, all get a slice), ``sharding`` (samplers),
``operations`` (nested-structure helpers: send_to_device, gather, pad...).
"""

from torchbay._lazy import serve_from

__all__ = ['prepare_data_loader', 'skip_first_batches', 'PreparedDataLoader', 'DataLoaderShard', 'DataLoaderDispatcher',
           'SkipFirstBatches', 'BatchSamplerShard', 'IterableShard', 'SeedableRandomSampler']
__getattr__, __dir__ = serve_from(__name__, "torchbay.data.loader", __all__)
