"""torchbay: run your own PyTorch training loop on any device, strategy and precision.

>>> from torchbay import Accelerator
>>> accelerator = Accelerator(mixed_precision="bf16")
>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""

from torchbay.accelerator import Accelerator
from torchbay.checkpointing import CheckpointIO
from torchbay.cluster import ClusterEnvironment
from torchbay.config import resolve_config
from torchbay.device import DeviceBackend
from torchbay.errors import CheckpointError, ConfigError, IncompatibleSetupError, LaunchError, PluginError, TorchbayError
from torchbay.kwargs import (AutocastKwargs, DataLoaderConfiguration, DistributedDataParallelKwargs,
                             GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                             ProjectConfiguration)
from torchbay.plugins import PluginManager, get_plugin_manager, hookimpl
from torchbay.precision import Precision
from torchbay.strategy import Strategy
from torchbay.utils import get_logger, set_seed, tqdm

__version__ = "0.1.0"

__all__ = [
    "Accelerator", "AutocastKwargs", "CheckpointError", "CheckpointIO", "ClusterEnvironment", "ConfigError",
    "DataLoaderConfiguration", "DeviceBackend", "DistributedDataParallelKwargs", "GradScalerKwargs",
    "GradientAccumulationPlugin", "IncompatibleSetupError", "InitProcessGroupKwargs", "LaunchError", "PluginError",
    "PluginManager", "Precision", "ProjectConfiguration", "Strategy", "TorchbayError", "get_logger",
    "get_plugin_manager", "hookimpl", "resolve_config", "set_seed", "tqdm",
]
