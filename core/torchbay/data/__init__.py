"""Prepared data loaders (Accelerate's ``accelerate.data_loader`` names): ``loader`` (sharding per process,
skipping, ``prepare_data_loader``), ``dispatch`` (one process reads, all get a slice), ``sharding`` (samplers),
``operations`` (nested-structure helpers: send_to_device, gather, pad...).
"""

from torchbay._lazy import serve_names

__all__ = ['prepare_data_loader', 'skip_first_batches', 'PreparedDataLoader', 'DataLoaderShard', 'DataLoaderDispatcher',
           'SkipFirstBatches', 'BatchSamplerShard', 'IterableShard', 'SeedableRandomSampler']
_IMPLEMENTATION = "torchbay.data.loader"
__getattr__, __dir__ = serve_names(__name__, {_IMPLEMENTATION: __all__}, fallback=(_IMPLEMENTATION,))
