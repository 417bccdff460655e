"""Helpers with Accelerate's names and signatures (what ``accelerate.utils`` offers), each imported on first use from
the module that implements it (``_LAZY``): the collectives of :mod:`torchbay.data.operations`, the settings objects of
:mod:`torchbay.config.handlers`, the launchers, the logger...

``is_<name>_available()`` is answered by the installed plugins (a device, a strategy or FP8
engine) or by whether a library is installed. Names that belong to a sharding strategy or
other backend come from that backend's plugin when it is installed. Any other Accelerate name
that torchbay does not offer raises :class:`~torchbay.errors.UnsupportedAPIError` saying what
to use instead (see docs/accelerate-compat.md).
"""

from typing import TYPE_CHECKING, Any

from torchbay._lazy import attach

_LAZY = {
    "set_seed": "torchbay.process.seeding",
    "synchronize_rng_state": "torchbay.process.seeding",
    "synchronize_rng_states": "torchbay.process.seeding",
    "CannotPadNestedTensorWarning": "torchbay.data.operations",
    "ConvertOutputsToFp32": "torchbay.data.operations",
    "DistributedOperationException": "torchbay.data.operations",
    "broadcast": "torchbay.data.operations",
    "is_torch_tensor": "torchbay.data.operations",
    "pad_input_tensors": "torchbay.data.operations",
    "broadcast_object_list": "torchbay.data.operations",
    "concatenate": "torchbay.data.operations",
    "convert_outputs_to_fp32": "torchbay.data.operations",
    "convert_to_fp32": "torchbay.data.operations",
    "copy_tensor_to_devices": "torchbay.data.operations",
    "find_batch_size": "torchbay.data.operations",
    "find_device": "torchbay.data.operations",
    "gather": "torchbay.data.operations",
    "gather_object": "torchbay.data.operations",
    "get_shape": "torchbay.data.operations",
    "honor_type": "torchbay.data.operations",
    "listify": "torchbay.data.operations",
    "pad_across_processes": "torchbay.data.operations",
    "recursively_apply": "torchbay.data.operations",
    "reduce": "torchbay.data.operations",
    "send_to_device": "torchbay.data.operations",
    "slice_tensors": "torchbay.data.operations",
    "AutocastKwargs": "torchbay.config.handlers",
    "DDPCommunicationHookType": "torchbay.config.handlers",
    "DataLoaderConfiguration": "torchbay.config.handlers",
    "DistributedDataParallelKwargs": "torchbay.config.handlers",
    "GradScalerKwargs": "torchbay.config.handlers",
    "GradientAccumulationPlugin": "torchbay.config.handlers",
    "InitProcessGroupKwargs": "torchbay.config.handlers",
    "KwargsHandler": "torchbay.config.handlers",
    "ProfileKwargs": "torchbay.config.handlers",
    "ProjectConfiguration": "torchbay.config.handlers",
    "DistributedType": "torchbay.process.state",
    "check_device_map": "torchbay.big_modeling.device_map",
    "check_device_same": "torchbay.big_modeling.device_map",
    "clean_device_map": "torchbay.big_modeling.device_map",
    "convert_file_size_to_int": "torchbay.big_modeling.device_map",
    "compute_module_sizes": "torchbay.big_modeling.device_map",
    "compute_module_total_buffer_size": "torchbay.big_modeling.device_map",
    "find_tied_parameters": "torchbay.big_modeling.device_map",
    "get_max_layer_size": "torchbay.big_modeling.device_map",
    "get_max_memory": "torchbay.big_modeling.device_map",
    "get_module_children_bottom_up": "torchbay.big_modeling.device_map",
    "get_module_leaves": "torchbay.big_modeling.device_map",
    "get_module_size_with_ties": "torchbay.big_modeling.device_map",
    "get_non_persistent_buffers": "torchbay.big_modeling.device_map",
    "id_tensor_storage": "torchbay.big_modeling.device_map",
    "named_module_tensors": "torchbay.big_modeling.device_map",
    "get_balanced_memory": "torchbay.big_modeling.infer",
    "infer_auto_device_map": "torchbay.big_modeling.infer",
    "load_checkpoint_in_model": "torchbay.big_modeling.loading",
    "load_offloaded_weights": "torchbay.big_modeling.loading",
    "set_module_tensor_to_device": "torchbay.big_modeling.loading",
    "remove_hook_from_module": "torchbay.big_modeling.hooks",
    "remove_hook_from_submodules": "torchbay.big_modeling.hooks",
    "align_module_device": "torchbay.big_modeling.align_hook",
    "has_offloaded_params": "torchbay.big_modeling.align_hook",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING": "torchbay.big_modeling.hook_placement",
    "OffloadedWeightsLoader": "torchbay.big_modeling.offload_index",
    "PrefixedDataset": "torchbay.big_modeling.offload_index",
    "load_offloaded_weight": "torchbay.big_modeling.offload_index",
    "offload_state_dict": "torchbay.big_modeling.offload_index",
    "offload_weight": "torchbay.big_modeling.offload_index",
    "save_offload_index": "torchbay.big_modeling.offload_index",
    "calculate_maximum_sizes": "torchbay.big_modeling.offload",
    "check_tied_parameters_on_same_device": "torchbay.big_modeling.offload",
    "clean_state_dict_for_safetensors": "torchbay.big_modeling.offload",
    "extract_submodules_state_dict": "torchbay.big_modeling.offload",
    "get_state_dict_from_offload": "torchbay.big_modeling.offload",
    "get_state_dict_offloaded_model": "torchbay.big_modeling.offload",
    "load_state_dict": "torchbay.big_modeling.offload",
    "retie_parameters": "torchbay.big_modeling.offload",
    "LoggerType": "torchbay.tracking.trackers",
    "DynamoBackend": "torchbay.compile.compiler",
    "TorchDynamoPlugin": "torchbay.compile.compiler",
    "compile_regions": "torchbay.compile.compiler",
    "has_compiled_regions": "torchbay.compile.compiler",
    "DeepSpeedSequenceParallelConfig": "torchbay.distributed.parallelism_config",
    "ParallelismConfig": "torchbay.distributed.parallelism_config",
    "TorchContextParallelConfig": "torchbay.distributed.parallelism_config",
    "TorchTensorParallelConfig": "torchbay.distributed.parallelism_config",
    "clear_environment": "torchbay.launch.notebook",
    "debug_launcher": "torchbay.launch.notebook",
    "notebook_launcher": "torchbay.launch.notebook",
    "patch_environment": "torchbay.launch.notebook",
    "is_habana_gaudi1": "torchbay.compat.names",
    "purge_accelerate_environment": "torchbay.compat.environment",
    "are_libraries_initialized": "torchbay.compat.environment",
    "CPUInformation": "torchbay.compat.environment",
    "get_cpu_distributed_information": "torchbay.compat.environment",
    "BnbQuantizationConfig": "torchbay.compat.bnb_config",
    "_convert_nargs_to_dict": "torchbay.cli.accelerate.launch_helpers",
    "convert_dict_to_env_variables": "torchbay.cli.accelerate.launch_helpers",
    "prepare_multi_gpu_env": "torchbay.cli.accelerate.launch_helpers",
    "prepare_simple_launcher_cmd_env": "torchbay.cli.accelerate.launch_helpers",
    "write_basic_config": "torchbay.cli.accelerate.launch_helpers",
    "PrecisionType": "torchbay.compat.helpers",
    "RNGType": "torchbay.compat.helpers",
    "TensorInformation": "torchbay.compat.helpers",
    "check_os_kernel": "torchbay.compat.helpers",
    "compare_versions": "torchbay.compat.helpers",
    "convert_bytes": "torchbay.compat.helpers",
    "dtype_byte_size": "torchbay.compat.helpers",
    "extract_model_from_parallel": "torchbay.compat.helpers",
    "get_model_tp_size": "torchbay.compat.helpers",
    "find_executable_batch_size": "torchbay.compat.helpers",
    "get_current_device_type": "torchbay.compat.helpers",
    "get_data_structure": "torchbay.compat.helpers",
    "get_grad_scaler": "torchbay.compat.helpers",
    "get_int_from_env": "torchbay.compat.helpers",
    "get_mixed_precision_context_manager": "torchbay.compat.helpers",
    "get_pretty_name": "torchbay.compat.helpers",
    "ignorant_find_batch_size": "torchbay.compat.helpers",
    "initialize_tensors": "torchbay.compat.helpers",
    "is_compiled_module": "torchbay.compat.helpers",
    "is_namedtuple": "torchbay.compat.helpers",
    "is_peft_model": "torchbay.compat.helpers",
    "is_port_in_use": "torchbay.compat.helpers",
    "is_tensor_information": "torchbay.compat.helpers",
    "is_torch_version": "torchbay.compat.helpers",
    "load": "torchbay.compat.helpers",
    "merge_dicts": "torchbay.compat.helpers",
    "parse_choice_from_env": "torchbay.compat.helpers",
    "parse_flag_from_env": "torchbay.compat.helpers",
    "recursive_getattr": "torchbay.compat.helpers",
    "release_memory": "torchbay.compat.helpers",
    "save": "torchbay.compat.helpers",
    "str_to_bool": "torchbay.config.flags",
    "model_has_dtensor": "torchbay.compat.helpers",
    "wait_for_everyone": "torchbay.compat.helpers",
    "MultiProcessAdapter": "torchbay.process.logger",
    "get_logger": "torchbay.process.logger",
    "tqdm": "torchbay.tracking.progress",
}


def _accelerate_name(name: str) -> Any:
    """Another Accelerate name: ``is_*_available``, a plugin's name, a refusal (torchbay/compat/names.py)."""
    from torchbay.compat import names

    value = names.resolve(name)
    if value is names.MISSING:
        raise AttributeError(f"module 'torchbay.utils' has no attribute {name!r}")
    return value


__getattr__, __dir__ = attach(__name__, _LAZY, otherwise=_accelerate_name)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["AutocastKwargs", "BnbQuantizationConfig", "CPUInformation", "CannotPadNestedTensorWarning",
           "ConvertOutputsToFp32", "DDPCommunicationHookType", "DataLoaderConfiguration",
           "DeepSpeedSequenceParallelConfig", "DistributedDataParallelKwargs", "DistributedOperationException",
           "DistributedType", "DynamoBackend", "GradScalerKwargs", "GradientAccumulationPlugin",
           "InitProcessGroupKwargs", "KwargsHandler", "LoggerType", "MultiProcessAdapter", "OffloadedWeightsLoader",
           "ParallelismConfig", "PrecisionType", "PrefixedDataset", "ProfileKwargs", "ProjectConfiguration", "RNGType",
           "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING", "TensorInformation", "TorchContextParallelConfig",
           "TorchDynamoPlugin", "TorchTensorParallelConfig", "_convert_nargs_to_dict", "align_module_device",
           "are_libraries_initialized", "broadcast", "broadcast_object_list", "calculate_maximum_sizes",
           "check_device_map", "check_device_same", "check_os_kernel", "check_tied_parameters_on_same_device",
           "clean_device_map", "clean_state_dict_for_safetensors", "clear_environment", "compare_versions",
           "compile_regions", "compute_module_sizes", "compute_module_total_buffer_size", "concatenate",
           "convert_bytes", "convert_dict_to_env_variables", "convert_file_size_to_int", "convert_outputs_to_fp32",
           "convert_to_fp32", "copy_tensor_to_devices", "debug_launcher", "dtype_byte_size",
           "extract_model_from_parallel", "extract_submodules_state_dict", "find_batch_size", "find_device",
           "find_executable_batch_size", "find_tied_parameters", "gather", "gather_object", "get_balanced_memory",
           "get_cpu_distributed_information", "get_current_device_type", "get_data_structure", "get_grad_scaler",
           "get_int_from_env", "get_logger", "get_max_layer_size", "get_max_memory",
           "get_mixed_precision_context_manager", "get_model_tp_size", "get_module_children_bottom_up",
           "get_module_leaves", "get_module_size_with_ties", "get_non_persistent_buffers", "get_pretty_name",
           "get_shape", "get_state_dict_from_offload", "get_state_dict_offloaded_model", "has_compiled_regions",
           "has_offloaded_params", "honor_type", "id_tensor_storage", "ignorant_find_batch_size",
           "infer_auto_device_map", "initialize_tensors", "is_compiled_module", "is_habana_gaudi1", "is_namedtuple",
           "is_peft_model", "is_port_in_use", "is_tensor_information", "is_torch_tensor", "is_torch_version", "listify",
           "load", "load_checkpoint_in_model", "load_offloaded_weight", "load_offloaded_weights", "load_state_dict",
           "merge_dicts", "model_has_dtensor", "named_module_tensors", "notebook_launcher", "offload_state_dict",
           "offload_weight", "pad_across_processes", "pad_input_tensors", "parse_choice_from_env",
           "parse_flag_from_env", "patch_environment", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env",
           "purge_accelerate_environment", "recursive_getattr", "recursively_apply", "reduce", "release_memory",
           "remove_hook_from_module", "remove_hook_from_submodules", "retie_parameters", "save", "save_offload_index",
           "send_to_device", "set_module_tensor_to_device", "set_seed", "slice_tensors", "str_to_bool",
           "synchronize_rng_state", "synchronize_rng_states", "tqdm", "wait_for_everyone", "write_basic_config"]

if TYPE_CHECKING:
    from torchbay.big_modeling.align_hook import align_module_device, has_offloaded_params
    from torchbay.big_modeling.device_map import (
        check_device_map,
        check_device_same,
        clean_device_map,
        compute_module_sizes,
        compute_module_total_buffer_size,
        convert_file_size_to_int,
        find_tied_parameters,
        get_max_layer_size,
        get_max_memory,
        get_module_children_bottom_up,
        get_module_leaves,
        get_module_size_with_ties,
        get_non_persistent_buffers,
        id_tensor_storage,
        named_module_tensors,
    )
    from torchbay.big_modeling.hook_placement import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
    from torchbay.big_modeling.hooks import remove_hook_from_module, remove_hook_from_submodules
    from torchbay.big_modeling.infer import get_balanced_memory, infer_auto_device_map
    from torchbay.big_modeling.loading import (
        load_checkpoint_in_model,
        load_offloaded_weights,
        set_module_tensor_to_device,
    )
    from torchbay.big_modeling.offload import (
        calculate_maximum_sizes,
        check_tied_parameters_on_same_device,
        clean_state_dict_for_safetensors,
        extract_submodules_state_dict,
        get_state_dict_from_offload,
        get_state_dict_offloaded_model,
        load_state_dict,
        retie_parameters,
    )
    from torchbay.big_modeling.offload_index import (
        OffloadedWeightsLoader,
        PrefixedDataset,
        load_offloaded_weight,
        offload_state_dict,
        offload_weight,
        save_offload_index,
    )
    from torchbay.cli.accelerate.launch_helpers import (
        _convert_nargs_to_dict,
        convert_dict_to_env_variables,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
        write_basic_config,
    )
    from torchbay.compat.bnb_config import BnbQuantizationConfig
    from torchbay.compat.environment import (
        CPUInformation,
        are_libraries_initialized,
        get_cpu_distributed_information,
        purge_accelerate_environment,
    )
    from torchbay.compat.helpers import (
        PrecisionType,
        RNGType,
        TensorInformation,
        check_os_kernel,
        compare_versions,
        convert_bytes,
        dtype_byte_size,
        extract_model_from_parallel,
        find_executable_batch_size,
        get_current_device_type,
        get_data_structure,
        get_grad_scaler,
        get_int_from_env,
        get_mixed_precision_context_manager,
        get_model_tp_size,
        get_pretty_name,
        ignorant_find_batch_size,
        initialize_tensors,
        is_compiled_module,
        is_namedtuple,
        is_peft_model,
        is_port_in_use,
        is_tensor_information,
        is_torch_version,
        load,
        merge_dicts,
        model_has_dtensor,
        parse_choice_from_env,
        parse_flag_from_env,
        recursive_getattr,
        release_memory,
        save,
        wait_for_everyone,
    )
    from torchbay.compat.names import is_habana_gaudi1
    from torchbay.compile.compiler import DynamoBackend, TorchDynamoPlugin, compile_regions, has_compiled_regions
    from torchbay.config.flags import str_to_bool
    from torchbay.config.handlers import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        KwargsHandler,
        ProfileKwargs,
        ProjectConfiguration,
    )
    from torchbay.data.operations import (
        CannotPadNestedTensorWarning,
        ConvertOutputsToFp32,
        DistributedOperationException,
        broadcast,
        broadcast_object_list,
        concatenate,
        convert_outputs_to_fp32,
        convert_to_fp32,
        copy_tensor_to_devices,
        find_batch_size,
        find_device,
        gather,
        gather_object,
        get_shape,
        honor_type,
        is_torch_tensor,
        listify,
        pad_across_processes,
        pad_input_tensors,
        recursively_apply,
        reduce,
        send_to_device,
        slice_tensors,
    )
    from torchbay.distributed.parallelism_config import (
        DeepSpeedSequenceParallelConfig,
        ParallelismConfig,
        TorchContextParallelConfig,
        TorchTensorParallelConfig,
    )
    from torchbay.launch.notebook import clear_environment, debug_launcher, notebook_launcher, patch_environment
    from torchbay.process.logger import MultiProcessAdapter, get_logger
    from torchbay.process.seeding import set_seed, synchronize_rng_state, synchronize_rng_states
    from torchbay.process.state import DistributedType
    from torchbay.tracking.progress import tqdm
    from torchbay.tracking.trackers import LoggerType
# -- end of the names written by scripts/public_names.py --
