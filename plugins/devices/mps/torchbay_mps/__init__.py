"""torchbay-mps: the 'mps' device for torchbay (Apple silicon GPUs (Metal Performance Shaders)).

Importing this package never imports the vendor runtime; see :mod:`torchbay_mps.plugin`.
"""

__version__ = "0.1.0"
