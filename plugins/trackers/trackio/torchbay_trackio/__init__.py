"""torchbay-trackio: the 'trackio' tracker for torchbay.

Importing this package never imports Trackio; see :mod:`torchbay_trackio.plugin`.
"""

__version__ = "0.1.0"
