"""torchbay: run your own PyTorch training loop on any device, strategy and precision.

>>> from torchbay import Accelerator
>>> accelerator = Accelerator(mixed_precision="bf16")
>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Names are imported on first use, so ``import torchbay`` (and every ``torchbay`` command
start) pays only for what it touches.
"""

import importlib
import importlib.util

__version__ = "0.1.0"

_EXPORTS = {
    "torchbay.accelerator": ["Accelerator"],
    "torchbay.big_modeling": ["cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model",
                              "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch"],
    "torchbay.checkpoint_loading": ["load_checkpoint_in_model"],
    "torchbay.device_map": ["infer_auto_device_map"],
    "torchbay.dispatch_hooks": ["remove_hook_from_module", "remove_hook_from_submodules"],
    "torchbay.checkpointing": ["CheckpointIO"],
    "torchbay.cluster": ["ClusterEnvironment"],
    "torchbay.config": ["resolve_config"],
    "torchbay.device": ["DeviceBackend"],
    "torchbay.errors": ["CheckpointError", "ConfigError", "IncompatibleSetupError", "LaunchError", "PluginError",
                        "TorchbayError"],
    "torchbay.kwargs": ["AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
                        "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs",
                        "InitProcessGroupKwargs", "ProfileKwargs", "ProjectConfiguration"],
    "torchbay.data": ["prepare_data_loader", "skip_first_batches"],
    "torchbay.helpers": ["find_executable_batch_size"],
    "torchbay.launchers": ["debug_launcher", "notebook_launcher"],
    "torchbay.parallelism_config": ["ParallelismConfig"],
    "torchbay.state": ["AcceleratorState", "DistributedType", "PartialState"],
    "torchbay.wrappers": ["GradientState"],
    "torchbay.plugins": ["PluginManager", "get_plugin_manager", "hookimpl"],
    "torchbay.precision": ["Precision"],
    "torchbay.strategy": ["Strategy"],
    "torchbay.utils": ["get_logger", "set_seed", "synchronize_rng_states", "tqdm"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        if name.startswith("_") or importlib.util.find_spec(f"torchbay.{name}") is not None:
            raise AttributeError(f"module 'torchbay' has no attribute {name!r}")  # (submodules import as usual)
        compat_names = importlib.import_module("torchbay.compat_names")  # Accelerate names: plugins or refusals
        value = compat_names.resolve(name)
        if value is compat_names.MISSING:
            raise AttributeError(f"module 'torchbay' has no attribute {name!r}")
        return value
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
