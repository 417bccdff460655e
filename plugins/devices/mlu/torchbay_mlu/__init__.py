"""torchbay-mlu: the 'mlu' device for torchbay (Cambricon MLUs (torch_mlu)).

Importing this package never imports the vendor runtime; see :mod:`torchbay_mlu.plugin`.
"""

__version__ = "0.1.0"
