"""Accelerate's ``accelerate.launchers`` path (implemented in :mod:`torchbay.launch.notebook`).
"""

from torchbay._lazy import serve_from

__all__ = ['debug_launcher', 'notebook_launcher']
__getattr__, __dir__ = serve_from(__name__, "torchbay.launch.notebook", __all__)
