"""torchbay-fp8-msamp: FP8 training through Microsoft MS-AMP (``fp8.backend: msamp``).

Importing this package (or its plugin module) does not import msamp; it is imported when
the engine is selected and ``prepare`` receives the model and optimizer.
"""

__version__ = "0.1.0"
