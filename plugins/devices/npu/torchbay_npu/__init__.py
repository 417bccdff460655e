"""torchbay-npu: the 'npu' device for torchbay (Huawei Ascend NPUs (torch_npu)).

Importing this package never imports the vendor runtime; see :mod:`torchbay_npu.plugin`.
"""

__version__ = "0.1.0"
