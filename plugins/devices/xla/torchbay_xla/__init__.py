"""torchbay-xla: the 'xla' device for torchbay (TPUs and other XLA devices (torch_xla)).

Importing this package never imports the vendor runtime; see :mod:`torchbay_xla.plugin`.
"""

__version__ = "0.1.0"
