"""torchbay-wandb: the 'wandb' tracker for torchbay.

Importing this package never imports wandb; see :mod:`torchbay_wandb.plugin`.
"""

__version__ = "0.1.0"
