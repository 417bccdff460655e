"""Helpers with Accelerate's names and signatures (what ``accelerate.utils`` offers).

Defined here: ``get_logger`` and ``tqdm``. The rest is
imported on first use from the module that implements it (``_EXPORTS``): the collectives of
:mod:`torchbay.data.operations`, the settings objects of :mod:`torchbay.config.handlers`, the launchers...
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
from typing import Any

_EXPORTS = {
    "torchbay.process.seeding": ["set_seed", "synchronize_rng_state", "synchronize_rng_states"],
    "torchbay.data.operations": ["CannotPadNestedTensorWarning", "ConvertOutputsToFp32",
                                 "DistributedOperationException", "broadcast", "is_torch_tensor", "pad_input_tensors",
                            "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32",
                            "copy_tensor_to_devices", "find_batch_size", "find_device", "gather", "gather_object",
                            "get_shape", "honor_type", "listify", "pad_across_processes", "recursively_apply",
                            "reduce", "send_to_device", "slice_tensors"],
    "torchbay.config.handlers": ["AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
                        "DistributedDataParallelKwargs", "GradScalerKwargs", "GradientAccumulationPlugin",
                        "InitProcessGroupKwargs", "KwargsHandler", "ProfileKwargs", "ProjectConfiguration"],
    "torchbay.process.state": ["DistributedType"],
    "torchbay.big_modeling.device_map": ["check_device_map", "check_device_same", "clean_device_map",
                            "convert_file_size_to_int", "compute_module_sizes", "compute_module_total_buffer_size",
                            "find_tied_parameters",
                            "get_max_layer_size", "get_max_memory", "get_module_children_bottom_up",
                            "get_module_leaves", "get_module_size_with_ties", "get_non_persistent_buffers",
                            "id_tensor_storage", "named_module_tensors"],
    "torchbay.big_modeling.infer": ["get_balanced_memory", "infer_auto_device_map"],
    "torchbay.big_modeling.loading": ["load_checkpoint_in_model", "load_offloaded_weights",
                                      "set_module_tensor_to_device"],
    "torchbay.big_modeling.hooks": ["remove_hook_from_module", "remove_hook_from_submodules"],
    "torchbay.big_modeling.align_hook": ["align_module_device", "has_offloaded_params"],
    "torchbay.big_modeling.hook_placement": ["SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING"],
    "torchbay.big_modeling.offload_index": ["OffloadedWeightsLoader", "PrefixedDataset", "load_offloaded_weight",
                               "offload_state_dict", "offload_weight", "save_offload_index"],
    "torchbay.big_modeling.offload": ["calculate_maximum_sizes", "check_tied_parameters_on_same_device",
                                 "clean_state_dict_for_safetensors", "extract_submodules_state_dict",
                                 "get_state_dict_from_offload", "get_state_dict_offloaded_model", "load_state_dict",
                                 "retie_parameters"],
    "torchbay.tracking.trackers": ["LoggerType"],
    "torchbay.compile.compiler": ["DynamoBackend", "TorchDynamoPlugin", "compile_regions", "has_compiled_regions"],
    "torchbay.distributed.parallelism_config": ["ParallelismConfig", "TorchContextParallelConfig",
                                                "TorchTensorParallelConfig"],
    "torchbay.launch.notebook": ["clear_environment", "debug_launcher", "notebook_launcher", "patch_environment"],
    "torchbay.compat.names": ["is_habana_gaudi1"],
    "torchbay.compat.environment": ["purge_accelerate_environment"],
    "torchbay.compat.bnb_config": ["BnbQuantizationConfig"],
    "torchbay.cli.accelerate.launch_helpers": ["_convert_nargs_to_dict", "convert_dict_to_env_variables",
                                       "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env",
                                       "write_basic_config"],
    "torchbay.compat.helpers": ["PrecisionType", "RNGType", "TensorInformation",
                         "check_os_kernel", "compare_versions", "convert_bytes",
                         "dtype_byte_size", "extract_model_from_parallel", "get_model_tp_size",
                         "find_executable_batch_size", "get_current_device_type", "get_data_structure",
                         "get_grad_scaler", "get_int_from_env", "get_mixed_precision_context_manager",
                         "get_pretty_name", "ignorant_find_batch_size", "initialize_tensors", "is_compiled_module",
                         "is_namedtuple", "is_peft_model", "is_port_in_use",
                         "is_tensor_information", "is_torch_version", "load", "merge_dicts",
                         "parse_choice_from_env", "parse_flag_from_env", "recursive_getattr",
                         "release_memory", "save", "str_to_bool", "wait_for_everyone"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted([*_WHERE, "get_logger", "tqdm"])


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    if name.startswith("_"):  # (``from torchbay.utils import x`` asks for __path__): no Accelerate name
        raise AttributeError(f"module 'torchbay.utils' has no attribute {name!r}")
    from torchbay.compat import names as compat_names

    value = compat_names.resolve(name)  # is_*_available, plugin-provided names, refusals
    if value is compat_names.MISSING:
        raise AttributeError(f"module 'torchbay.utils' has no attribute {name!r}")
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _state():
    from torchbay.process.state import PartialState

    return PartialState()


def _is_main(local: bool) -> bool:
    return int(os.environ.get("LOCAL_RANK" if local else "RANK", "0")) == 0


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logs on the main process only, unless ``main_process_only=False``; ``in_order=True`` logs
    every process's message in process order (a collective: call it on every process)."""

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False, **kwargs):
        if not self.isEnabledFor(level):
            return
        # the record names the caller of logger.info(...), not this method (logging skips its own frames)
        kwargs.setdefault("stacklevel", 2)
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
    is not a terminal (a log file), a few plain lines instead of a redrawn bar (torchbay.tracking.progress)."""
    from torchbay.tracking.progress import progress_bar

    if args and isinstance(args[0], bool):  # Accelerate's old tqdm(main_process_only, iterable)
        main_process_only, args = args[0], args[1:]
    return progress_bar(*args, main_process_only=main_process_only, **kwargs)

