"""torchbay: run your own PyTorch training loop on any device, strategy and precision.

>>> from torchbay import Accelerator
>>> accelerator = Accelerator(mixed_precision="bf16")
>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Names are imported on first use (torchbay/_lazy.py), so ``import torchbay`` (and every ``torchbay`` command
start) pays only for what it touches.
"""

import importlib.util
from typing import TYPE_CHECKING

from torchbay import _moved
from torchbay._lazy import attach
from torchbay._version import __version__ as __version__

_moved.install()  # the 0.1 module paths, for one release (torchbay/_moved.py)

_LAZY = {
    "Accelerator": "torchbay.accelerator.accelerator",
    "LocalSGD": "torchbay.accelerator.local_sgd",
    "AcceleratorState": "torchbay.process.state",
    "DistributedType": "torchbay.process.state",
    "PartialState": "torchbay.process.state",
    "GradientState": "torchbay.data.gradient_state",
    "set_seed": "torchbay.process.seeding",
    "synchronize_rng_states": "torchbay.process.seeding",
    "resolve_config": "torchbay.registry.resolve",
    "prepare_data_loader": "torchbay.data.prepare",
    "skip_first_batches": "torchbay.data.prepare",
    "find_executable_batch_size": "torchbay.compat.helpers",
    "debug_launcher": "torchbay.launch.notebook",
    "notebook_launcher": "torchbay.launch.notebook",
    "get_logger": "torchbay.process.logger",
    "tqdm": "torchbay.tracking.progress",
    # Accelerate's settings objects
    "AutocastKwargs": "torchbay.config.handlers",
    "DDPCommunicationHookType": "torchbay.config.handlers",
    "DataLoaderConfiguration": "torchbay.config.handlers",
    "DistributedDataParallelKwargs": "torchbay.config.handlers",
    "GradientAccumulationPlugin": "torchbay.config.handlers",
    "GradScalerKwargs": "torchbay.config.handlers",
    "InitProcessGroupKwargs": "torchbay.config.handlers",
    "ProfileKwargs": "torchbay.config.handlers",
    "ProjectConfiguration": "torchbay.config.handlers",
    "ParallelismConfig": "torchbay.distributed.parallelism_config",
    "DeepSpeedSequenceParallelConfig": "torchbay.distributed.parallelism_config",
    # big-model inference
    "cpu_offload": "torchbay.big_modeling.modeling",
    "cpu_offload_with_hook": "torchbay.big_modeling.modeling",
    "disk_offload": "torchbay.big_modeling.modeling",
    "dispatch_model": "torchbay.big_modeling.modeling",
    "init_empty_weights": "torchbay.big_modeling.modeling",
    "init_on_device": "torchbay.big_modeling.modeling",
    "load_checkpoint_and_dispatch": "torchbay.big_modeling.modeling",
    "load_checkpoint_in_model": "torchbay.big_modeling.loading",
    "infer_auto_device_map": "torchbay.big_modeling.infer",
    "remove_hook_from_module": "torchbay.big_modeling.hooks",
    "remove_hook_from_submodules": "torchbay.big_modeling.hooks",
    # the axes and the plugin manager
    "DeviceBackend": "torchbay.axes.device",
    "Strategy": "torchbay.axes.strategy",
    "Precision": "torchbay.axes.precision",
    "CheckpointIO": "torchbay.axes.checkpoint_io",
    "ClusterEnvironment": "torchbay.axes.cluster",
    "PluginManager": "torchbay.registry.manager",
    "get_plugin_manager": "torchbay.registry.manager",
    "hookimpl": "torchbay.registry.manager",
    # the exceptions
    "TorchbayError": "torchbay.errors",
    "CheckpointError": "torchbay.errors",
    "ConfigError": "torchbay.errors",
    "IncompatibleSetupError": "torchbay.errors",
    "LaunchError": "torchbay.errors",
    "PluginError": "torchbay.errors",
}


def _accelerate_name(name: str):
    """Another Accelerate name: served by an installed plugin, or refused with advice (torchbay/compat/names.py)."""
    if importlib.util.find_spec(f"torchbay.{name}") is not None:  # a submodule not imported yet: imports as usual
        raise AttributeError(f"module 'torchbay' has no attribute {name!r}")
    from torchbay.compat import names

    value = names.resolve(name)
    if value is names.MISSING:
        raise AttributeError(f"module 'torchbay' has no attribute {name!r}")
    return value


__getattr__, __dir__ = attach(__name__, _LAZY, otherwise=_accelerate_name)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["Accelerator", "AcceleratorState", "AutocastKwargs", "CheckpointError", "CheckpointIO", "ClusterEnvironment",
           "ConfigError", "DDPCommunicationHookType", "DataLoaderConfiguration", "DeepSpeedSequenceParallelConfig",
           "DeviceBackend", "DistributedDataParallelKwargs", "DistributedType", "GradScalerKwargs",
           "GradientAccumulationPlugin", "GradientState", "IncompatibleSetupError", "InitProcessGroupKwargs",
           "LaunchError", "LocalSGD", "ParallelismConfig", "PartialState", "PluginError", "PluginManager", "Precision",
           "ProfileKwargs", "ProjectConfiguration", "Strategy", "TorchbayError", "cpu_offload", "cpu_offload_with_hook",
           "debug_launcher", "disk_offload", "dispatch_model", "find_executable_batch_size", "get_logger",
           "get_plugin_manager", "hookimpl", "infer_auto_device_map", "init_empty_weights", "init_on_device",
           "load_checkpoint_and_dispatch", "load_checkpoint_in_model", "notebook_launcher", "prepare_data_loader",
           "remove_hook_from_module", "remove_hook_from_submodules", "resolve_config", "set_seed", "skip_first_batches",
           "synchronize_rng_states", "tqdm"]

if TYPE_CHECKING:
    from torchbay.accelerator.accelerator import Accelerator
    from torchbay.accelerator.local_sgd import LocalSGD
    from torchbay.axes.checkpoint_io import CheckpointIO
    from torchbay.axes.cluster import ClusterEnvironment
    from torchbay.axes.device import DeviceBackend
    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import Strategy
    from torchbay.big_modeling.hooks import remove_hook_from_module, remove_hook_from_submodules
    from torchbay.big_modeling.infer import infer_auto_device_map
    from torchbay.big_modeling.loading import load_checkpoint_in_model
    from torchbay.big_modeling.modeling import (
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        init_empty_weights,
        init_on_device,
        load_checkpoint_and_dispatch,
    )
    from torchbay.compat.helpers import find_executable_batch_size
    from torchbay.config.handlers import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
        ProjectConfiguration,
    )
    from torchbay.data.gradient_state import GradientState
    from torchbay.data.prepare import prepare_data_loader, skip_first_batches
    from torchbay.distributed.parallelism_config import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from torchbay.errors import (
        CheckpointError,
        ConfigError,
        IncompatibleSetupError,
        LaunchError,
        PluginError,
        TorchbayError,
    )
    from torchbay.launch.notebook import debug_launcher, notebook_launcher
    from torchbay.process.logger import get_logger
    from torchbay.process.seeding import set_seed, synchronize_rng_states
    from torchbay.process.state import AcceleratorState, DistributedType, PartialState
    from torchbay.registry.manager import PluginManager, get_plugin_manager, hookimpl
    from torchbay.registry.resolve import resolve_config
    from torchbay.tracking.progress import tqdm
# -- end of the names written by scripts/public_names.py --
