"""torchbay-deepspeed: DeepSpeed ZeRO as a torchbay strategy (``strategy: deepspeed``).

Importing this package does not import deepspeed; the strategy imports it when selected.
"""

from torchbay_deepspeed.objects import DummyOptim, DummyScheduler

__all__ = ["DummyOptim", "DummyScheduler"]
__version__ = "0.1.0"
