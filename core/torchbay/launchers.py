"""Accelerate's ``accelerate.launchers`` path (implemented in :mod:`torchbay.launch.notebook`).
"""

from torchbay._lazy import serve_names

__all__ = ['debug_launcher', 'notebook_launcher']
_IMPLEMENTATION = "torchbay.launch.notebook"
__getattr__, __dir__ = serve_names(__name__, {_IMPLEMENTATION: __all__}, fallback=(_IMPLEMENTATION,))
