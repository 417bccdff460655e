"""torchbay-cuda: the 'cuda' device for torchbay (NVIDIA CUDA and AMD ROCm (HIP) GPUs).

Importing this package never imports the vendor runtime; see :mod:`torchbay_cuda.plugin`.
"""

__version__ = "0.1.0"
