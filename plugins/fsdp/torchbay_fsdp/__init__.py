"""torchbay-fsdp: fully sharded data parallel as a torchbay strategy (``strategy: fsdp``).

Importing this package imports neither ``torch.distributed.fsdp`` nor
``torch.distributed.checkpoint``; they are imported when the strategy is built.
"""

__version__ = "0.1.0"
