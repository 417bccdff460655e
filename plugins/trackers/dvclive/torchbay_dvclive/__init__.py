"""torchbay-dvclive: the 'dvclive' tracker for torchbay.

Importing this package never imports DVCLive; see :mod:`torchbay_dvclive.plugin`.
"""

__version__ = "0.1.0"
