"""torchbay-tensorboard: the 'tensorboard' tracker for torchbay.

Importing this package never imports TensorBoard; see :mod:`torchbay_tensorboard.plugin`.
"""

__version__ = "0.1.0"
