"""torchbay: run your own PyTorch training loop on any device, strategy and precision.

>>> from torchbay import Accelerator
>>> accelerator = Accelerator(mixed_precision="bf16")
>>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Names are imported on first use, so ``import torchbay`` (and every ``torchbay`` command
start) pays only for what it touches.
"""

import importlib
import importlib.util

from torchbay import _moved
from torchbay._version import __version__ as __version__

_moved.install()  # the 0.1 module paths, for one release (torchbay/_moved.py)

_EXPORTS = {
    "torchbay.accelerator.accelerator": ["Accelerator"],
    "torchbay.big_modeling.modeling": ["cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model",
                              "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch"],
    "torchbay.big_modeling.loading": ["load_checkpoint_in_model"],
    "torchbay.big_modeling.infer": ["infer_auto_device_map"],
    "torchbay.big_modeling.hooks": ["remove_hook_from_module", "remove_hook_from_submodules"],
    "torchbay.axes.checkpoint_io": ["CheckpointIO"],
    "torchbay.axes.cluster": ["ClusterEnvironment"],
    "torchbay.plugin.resolve": ["resolve_config"],
    "torchbay.axes.device": ["DeviceBackend"],
    "torchbay.errors": ["CheckpointError", "ConfigError", "IncompatibleSetupError", "LaunchError", "PluginError",
                        "TorchbayError"],
    "torchbay.config.handlers": ["AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
                        "DistributedDataParallelKwargs", "GradientAccumulationPlugin", "GradScalerKwargs",
                        "InitProcessGroupKwargs", "ProfileKwargs", "ProjectConfiguration"],
    "torchbay.data.loader": ["prepare_data_loader", "skip_first_batches"],
    "torchbay.compat.helpers": ["find_executable_batch_size"],
    "torchbay.launch.notebook": ["debug_launcher", "notebook_launcher"],
    "torchbay.distributed.parallelism_config": ["ParallelismConfig"],
    "torchbay.accelerator.local_sgd": ["LocalSGD"],
    "torchbay.process.state": ["AcceleratorState", "DistributedType", "PartialState"],
    "torchbay.data.gradient_state": ["GradientState"],
    "torchbay.plugin.manager": ["PluginManager", "get_plugin_manager", "hookimpl"],
    "torchbay.axes.precision": ["Precision"],
    "torchbay.axes.strategy": ["Strategy"],
    "torchbay.process.seeding": ["set_seed", "synchronize_rng_states"],
    "torchbay.utils": ["get_logger", "tqdm"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        if name.startswith("_") or importlib.util.find_spec(f"torchbay.{name}") is not None:
            raise AttributeError(f"module 'torchbay' has no attribute {name!r}")  # (submodules import as usual)
        compat_names = importlib.import_module("torchbay.compat.names")  # Accelerate names: plugins or refusals
        value = compat_names.resolve(name)
        if value is compat_names.MISSING:
            raise AttributeError(f"module 'torchbay' has no attribute {name!r}")
        return value
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
