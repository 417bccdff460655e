"""torchbay-xpu: the 'xpu' device for torchbay (Intel GPUs through torch's native XPU support
(intel-extension-for-pytorch optional)).

Importing this package never imports the vendor runtime; see :mod:`torchbay_xpu.plugin`.
"""

__version__ = "0.1.0"
