"""Helpers with Accelerate's names and signatures (what ``accelerate.utils`` offers).

Defined here: ``set_seed``, ``get_logger``, ``tqdm``, ``synchronize_rng_states``. The rest is
imported on first use from the module that implements it (``_EXPORTS``): the collectives of
:mod:`torchbay.operations`, the settings objects of :mod:`torchbay.kwargs`, the launchers...
``is_<name>_available()`` is answered by the installed plugins (a device, a strategy or FP8
engine) or by whether a library is installed. Names that belong to a sharding strategy or
other backend come from that backend's plugin when it is installed. Any other Accelerate name
that torchbay does not offer raises :class:`~torchbay.errors.UnsupportedAPIError` saying what
to use instead (see docs/accelerate-compat.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import random as _random
from typing import Any

import numpy as np
import torch

_EXPORTS = {
    "torchbay.operations": ["ConvertOutputsToFp32", "DistributedOperationException", "broadcast",
                            "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32",
                            "copy_tensor_to_devices", "find_batch_size", "find_device", "gather", "gather_object",
                            "get_shape", "honor_type", "listify", "pad_across_processes", "recursively_apply",
                            "reduce", "send_to_device", "slice_tensors"],
    "torchbay.kwargs": ["AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
                        "DistributedDataParallelKwargs", "GradScalerKwargs", "GradientAccumulationPlugin",
                        "InitProcessGroupKwargs", "KwargsHandler", "ProfileKwargs", "ProjectConfiguration"],
    "torchbay.state": ["DistributedType"],
    "torchbay.device_map": ["check_device_map", "check_device_same", "clean_device_map", "compute_module_sizes",
                            "compute_module_total_buffer_size", "find_tied_parameters", "get_balanced_memory",
                            "get_max_layer_size", "get_max_memory", "get_module_children_bottom_up",
                            "get_module_leaves", "get_module_size_with_ties", "get_non_persistent_buffers",
                            "id_tensor_storage", "infer_auto_device_map", "named_module_tensors"],
    "torchbay.checkpoint_loading": ["load_checkpoint_in_model", "set_module_tensor_to_device"],
    "torchbay.dispatch_hooks": ["align_module_device", "has_offloaded_params", "remove_hook_from_module",
                                "remove_hook_from_submodules"],
    "torchbay.hook_placement": ["SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING"],
    "torchbay.offload_index": ["OffloadedWeightsLoader", "PrefixedDataset", "load_offloaded_weight",
                               "load_offloaded_weights", "offload_state_dict", "offload_weight", "save_offload_index"],
    "torchbay.big_model_utils": ["calculate_maximum_sizes", "check_tied_parameters_on_same_device",
                                 "clean_state_dict_for_safetensors", "extract_submodules_state_dict",
                                 "get_state_dict_from_offload", "get_state_dict_offloaded_model", "load_state_dict",
                                 "retie_parameters"],
    "torchbay.tracking": ["LoggerType"],
    "torchbay.compile": ["DynamoBackend", "TorchDynamoPlugin", "compile_regions", "has_compiled_regions"],
    "torchbay.parallelism_config": ["ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"],
    "torchbay.launchers": ["debug_launcher", "notebook_launcher"],
    "torchbay.helpers": ["CannotPadNestedTensorWarning", "PrecisionType", "RNGType", "TensorInformation",
                         "check_os_kernel", "clear_environment", "compare_versions", "convert_bytes",
                         "convert_file_size_to_int", "dtype_byte_size", "extract_model_from_parallel",
                         "find_executable_batch_size", "get_current_device_type", "get_data_structure",
                         "get_grad_scaler", "get_int_from_env", "get_mixed_precision_context_manager",
                         "get_pretty_name", "ignorant_find_batch_size", "initialize_tensors", "is_compiled_module",
                         "is_habana_gaudi1", "is_namedtuple", "is_peft_model", "is_port_in_use",
                         "is_tensor_information", "is_torch_tensor", "is_torch_version", "load", "merge_dicts",
                         "parse_choice_from_env", "parse_flag_from_env", "patch_environment", "recursive_getattr",
                         "release_memory", "save", "str_to_bool", "wait_for_everyone"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted([*_WHERE, "get_logger", "set_seed", "synchronize_rng_state", "synchronize_rng_states", "tqdm"])


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    if name.startswith("_"):  # (``from torchbay.utils import x`` asks for __path__): no Accelerate name
        raise AttributeError(f"module 'torchbay.utils' has no attribute {name!r}")
    from torchbay import compat_names

    value = compat_names.resolve(name)  # is_*_available, plugin-provided names, refusals
    if value is compat_names.MISSING:
        raise AttributeError(f"module 'torchbay.utils' has no attribute {name!r}")
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy, torch and every accelerator torch knows."""
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    _random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds the current accelerator's generators
    from torchbay.accelerator import live_device_backends

    for backend in live_device_backends():  # devices whose generators torch.manual_seed does not reach
        backend.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: Any = None, generator: torch.Generator | None = None) -> None:
    """Give every process the main process's state of one generator.

    ``rng_type``: ``"torch"`` (the CPU generator), ``"generator"`` (``generator``), or a device
    name (that device's default generators, through its device plugin).
    """
    from torchbay.state import PartialState

    state = PartialState()
    strategy = state._strategy
    kind = getattr(rng_type, "value", rng_type) or "torch"
    if strategy.world_size <= 1:
        return
    if kind == "torch":
        torch.set_rng_state(strategy.broadcast_object(torch.get_rng_state()))
    elif kind == "generator":
        if generator is None:
            from torchbay.errors import TorchbayError

            raise TorchbayError("synchronize_rng_states(['generator']) needs generator=")
        generator.set_state(strategy.broadcast_object(generator.get_state()))
    else:
        backend = strategy.device_backend
        if kind != backend.name:
            return  # a device this run does not use: nothing to synchronise (as Accelerate skips it)
        backend.set_rng_state(strategy.broadcast_object(backend.get_rng_state()))


def synchronize_rng_states(rng_types: list[Any], generator: torch.Generator | None = None) -> None:
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)


def _state():
    from torchbay.state import PartialState

    return PartialState()


def _is_main(local: bool) -> bool:
    return int(os.environ.get("LOCAL_RANK" if local else "RANK", "0")) == 0


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logs on the main process only, unless ``main_process_only=False``; ``in_order=True`` logs
    every process's message in process order (a collective: call it on every process)."""

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False, **kwargs):
        if not self.isEnabledFor(level):
            return
        if not main_process_only and in_order:
            state = _state()
            for index in range(state.num_processes):
                if index == state.process_index:
                    m, kw = self.process(msg, dict(kwargs))
                    self.logger.log(level, m, *args, **kw)
                    for handler in self.logger.handlers + logging.getLogger().handlers:
                        handler.flush()
                state.wait_for_everyone()
            return
        if not main_process_only or _is_main(local=False):
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)

    def warning_once(self, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_warned", set())
        if key not in seen:
            seen.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    logger = logging.getLogger(name)
    level = log_level or os.environ.get("TORCHBAY_LOG_LEVEL")
    if level:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any):
    """``tqdm.auto.tqdm``, disabled on every process but the local main one by default; when stderr
    is not a terminal (a log file), a few plain lines instead of a redrawn bar (torchbay.progress)."""
    from torchbay.progress import progress_bar

    if args and isinstance(args[0], bool):  # Accelerate's old tqdm(main_process_only, iterable)
        main_process_only, args = args[0], args[1:]
    return progress_bar(*args, main_process_only=main_process_only, **kwargs)

