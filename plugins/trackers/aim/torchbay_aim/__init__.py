"""torchbay-aim: the 'aim' tracker for torchbay.

Importing this package never imports Aim; see :mod:`torchbay_aim.plugin`.
"""

__version__ = "0.1.0"
