"""The files of a checkpoint, below every layer that writes or reads one: digests and fsync (``files``), the
manifest and atomic publish of a checkpoint folder (``publish``), reading pickles without running code
(``safe_load``) and reading files straight into the tensors a run holds (``inplace``). It imports nothing of
torchbay but :mod:`torchbay.errors`, so a strategy, a collective or a loader can use it."""
