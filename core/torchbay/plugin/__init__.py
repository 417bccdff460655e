"""The plugin-author API: everything a torchbay plugin may import, in one place.

A plugin (a device, strategy, precision, checkpoint io, cluster environment or tracker, in a distribution of its
own) imports from ``torchbay.plugin`` - and from ``torchbay`` (the user API), ``torchbay.hookspecs`` (the hook
contract), ``torchbay.errors`` and, in its tests, ``torchbay.testing`` - and nothing else: those names are the
promise, versioned by :data:`API_VERSION` (see :mod:`torchbay.registry.api_version`). Every other module of torchbay
is internal and may move. Names are imported on first use, so importing this package costs nothing.

>>> from torchbay.plugin import DeviceBackend, hookimpl
>>> TORCHBAY_PLUGIN_API = (1, 0)
"""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "API_VERSION": "torchbay.registry.api_version",
    "hookimpl": "torchbay.registry.manager",
    "LazyClass": "torchbay.registry.lazy_class",
    "library_version": "torchbay.registry.info",
    "RunContext": "torchbay.axes.context",
    # the axes a plugin implements
    "DeviceBackend": "torchbay.axes.device",
    "flops_key": "torchbay.axes.device",  # the dtype keys of DeviceBackend.peak_flops (API 1.3)
    "Strategy": "torchbay.axes.strategy",
    "MemoryEstimate": "torchbay.axes.strategy",
    "optimizer_owners": "torchbay.axes.strategy",
    "Precision": "torchbay.axes.precision",
    "CheckpointIO": "torchbay.axes.checkpoint_io",
    "ClusterEnvironment": "torchbay.axes.cluster",
    # trackers: the base class, its error, what a tracker plugin turns logged values into
    "GeneralTracker": "torchbay.tracking.trackers",
    "TrackerError": "torchbay.tracking.trackers",
    "say": "torchbay.tracking.trackers",
    "flatten": "torchbay.tracking.values",
    "hparam_value": "torchbay.tracking.values",
    "split_scalars": "torchbay.tracking.values",
    "to_python": "torchbay.tracking.values",
    "read_scalars": "torchbay.tracking.jsonl",
    # configuration a plugin adds: its section, its Accelerate-config fragment, its CLI flags
    "Section": "torchbay.config.model",
    "read_fragment": "torchbay.registry.fragments",
    "add_section_options": "torchbay.cli.options",
    "ParallelismConfig": "torchbay.distributed.parallelism_config",
    "MESH_ORDER": "torchbay.distributed.parallelism_config",
    # what a strategy that builds the mesh checks (API 1.3): sizes, the pipeline's schedules, Ulysses' attention
    "parallel_sizes": "torchbay.distributed.parallelism_config",
    "SP_ATTN_IMPLEMENTATIONS": "torchbay.distributed.parallelism_config",
    "refuse_recurrent_layers": "torchbay.distributed.sequence",
    "SCHEDULES": "torchbay.distributed.pipeline_config",
    "DEFAULT_SCHEDULE": "torchbay.distributed.pipeline_config",
    "check_pipeline": "torchbay.distributed.pipeline_config",
    "default_microbatches": "torchbay.distributed.pipeline_config",
    "virtual_stages": "torchbay.distributed.pipeline_config",
    # Accelerate's config files as torchbay reads them (for an `accelerate` command a plugin serves; API 1.2)
    "load_config_from_file": "torchbay.compat.accelerate_config_file",
    "default_config_file": "torchbay.compat.accelerate_config_file",
    # checkpoints: safe loading, the files a save wrote, publishing a model folder
    "safe_torch_load": "torchbay.storage.safe_load",
    "dcp_load": "torchbay.storage.safe_load",
    "dcp_load_full": "torchbay.storage.safe_load",
    "file_record": "torchbay.storage.files",
    "fsync_dir": "torchbay.storage.files",
    "dcp_files_of_rank": "torchbay.storage.files",
    "read_manifest": "torchbay.storage.publish",
    "remove_own_checkpoint": "torchbay.storage.publish",
    "publish_model": "torchbay.checkpoint.checkpointer",
    "StagingBuffer": "torchbay.checkpoint.async_save",
    "PreparedScheduler": "torchbay.accelerator.prepared",
    # the exceptions
    "TorchbayError": "torchbay.errors",
    "ConfigError": "torchbay.errors",
    "CheckpointError": "torchbay.errors",
    "IncompatibleSetupError": "torchbay.errors",
    "PluginError": "torchbay.errors",
    "LaunchError": "torchbay.errors",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["API_VERSION", "CheckpointError", "CheckpointIO", "ClusterEnvironment", "ConfigError", "DEFAULT_SCHEDULE",
           "DeviceBackend", "GeneralTracker", "IncompatibleSetupError", "LaunchError", "LazyClass", "MESH_ORDER",
           "MemoryEstimate", "ParallelismConfig", "PluginError", "Precision", "PreparedScheduler", "RunContext",
           "SCHEDULES", "SP_ATTN_IMPLEMENTATIONS", "Section", "StagingBuffer", "Strategy", "TorchbayError",
           "TrackerError", "add_section_options", "check_pipeline", "dcp_files_of_rank", "dcp_load", "dcp_load_full",
           "default_config_file", "default_microbatches", "file_record", "flatten", "flops_key", "fsync_dir",
           "hookimpl", "hparam_value", "library_version", "load_config_from_file", "optimizer_owners", "parallel_sizes",
           "publish_model", "read_fragment", "read_manifest", "read_scalars", "refuse_recurrent_layers",
           "remove_own_checkpoint", "safe_torch_load", "say", "split_scalars", "to_python", "virtual_stages"]

if TYPE_CHECKING:
    from torchbay.accelerator.prepared import PreparedScheduler
    from torchbay.axes.checkpoint_io import CheckpointIO
    from torchbay.axes.cluster import ClusterEnvironment
    from torchbay.axes.context import RunContext
    from torchbay.axes.device import DeviceBackend, flops_key
    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import MemoryEstimate, Strategy, optimizer_owners
    from torchbay.checkpoint.async_save import StagingBuffer
    from torchbay.checkpoint.checkpointer import publish_model
    from torchbay.cli.options import add_section_options
    from torchbay.compat.accelerate_config_file import default_config_file, load_config_from_file
    from torchbay.config.model import Section
    from torchbay.distributed.parallelism_config import (
        MESH_ORDER,
        SP_ATTN_IMPLEMENTATIONS,
        ParallelismConfig,
        parallel_sizes,
    )
    from torchbay.distributed.pipeline_config import (
        DEFAULT_SCHEDULE,
        SCHEDULES,
        check_pipeline,
        default_microbatches,
        virtual_stages,
    )
    from torchbay.distributed.sequence import refuse_recurrent_layers
    from torchbay.errors import (
        CheckpointError,
        ConfigError,
        IncompatibleSetupError,
        LaunchError,
        PluginError,
        TorchbayError,
    )
    from torchbay.registry.api_version import API_VERSION
    from torchbay.registry.fragments import read_fragment
    from torchbay.registry.info import library_version
    from torchbay.registry.lazy_class import LazyClass
    from torchbay.registry.manager import hookimpl
    from torchbay.storage.files import dcp_files_of_rank, file_record, fsync_dir
    from torchbay.storage.publish import read_manifest, remove_own_checkpoint
    from torchbay.storage.safe_load import dcp_load, dcp_load_full, safe_torch_load
    from torchbay.tracking.jsonl import read_scalars
    from torchbay.tracking.trackers import GeneralTracker, TrackerError, say
    from torchbay.tracking.values import flatten, hparam_value, split_scalars, to_python
# -- end of the names written by scripts/public_names.py --
