"""torchbay-fp8-te: FP8 training through NVIDIA Transformer Engine (``fp8.backend: te``).

Importing this package (or its plugin module) does not import transformer_engine; it is
imported when the engine is selected.
"""

__version__ = "0.1.0"
