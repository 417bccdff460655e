"""torchbay-hpu: the 'hpu' device for torchbay (Intel Gaudi accelerators (habana_frameworks)).

Importing this package never imports the vendor runtime; see :mod:`torchbay_hpu.plugin`.
"""

__version__ = "0.1.0"
