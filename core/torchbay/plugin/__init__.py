"""The plugin-author API: everything a torchbay plugin may import, in one place.

A plugin (a device, strategy, precision, checkpoint io, cluster environment or tracker, in a distribution of its
own) imports from ``torchbay.plugin`` - and from ``torchbay`` (the user API), ``torchbay.hookspecs`` (the hook
contract), ``torchbay.errors`` and, in its tests, ``torchbay.testing`` - and nothing else: those names are the
promise, versioned by :data:`API_VERSION` (see :mod:`torchbay.plugin.api_version`). Every other module of torchbay
is internal and may move. Names are imported on first use, so importing this package costs nothing.

>>> from torchbay.plugin import DeviceBackend, hookimpl
>>> TORCHBAY_PLUGIN_API = (1, 0)
"""

from torchbay._lazy import serve_names

_SOURCES = {
    "torchbay.plugin.api_version": ["API_VERSION"],
    "torchbay.plugin.manager": ["hookimpl"],
    "torchbay.plugin.lazy_class": ["LazyClass"],
    "torchbay.plugin.info": ["library_version"],
    "torchbay.axes.context": ["RunContext"],
    # the axes a plugin implements
    "torchbay.axes.device": ["DeviceBackend"],
    "torchbay.axes.strategy": ["Strategy", "MemoryEstimate", "optimizer_owners"],
    "torchbay.axes.precision": ["Precision"],
    "torchbay.axes.checkpoint_io": ["CheckpointIO"],
    "torchbay.axes.cluster": ["ClusterEnvironment"],
    "torchbay.tracking.trackers": ["GeneralTracker", "TrackerError", "say"],
    "torchbay.tracking.values": ["flatten", "hparam_value", "split_scalars", "to_python"],
    "torchbay.tracking.jsonl": ["read_scalars"],
    # configuration a plugin adds: its section, its Accelerate-config fragment, its CLI flags
    "torchbay.config.model": ["Section"],
    "torchbay.plugin.fragments": ["read_fragment"],
    "torchbay.cli.options": ["add_section_options"],
    "torchbay.distributed.parallelism_config": ["ParallelismConfig", "MESH_ORDER"],
    # Accelerate's config files as torchbay reads them (for an `accelerate` command a plugin serves; API 1.2)
    "torchbay.compat.accelerate_config_file": ["load_config_from_file", "default_config_file"],
    # checkpoints: safe loading, the files a save wrote, publishing a model folder
    "torchbay.storage.safe_load": ["safe_torch_load", "dcp_load", "dcp_load_full"],
    "torchbay.storage.files": ["file_record", "fsync_dir", "dcp_files_of_rank"],
    "torchbay.storage.publish": ["read_manifest", "remove_own_checkpoint"],
    "torchbay.checkpoint.checkpointer": ["publish_model"],
    "torchbay.checkpoint.async_save": ["StagingBuffer"],
    "torchbay.accelerator.prepared": ["PreparedScheduler"],
    "torchbay.errors": ["TorchbayError", "ConfigError", "CheckpointError", "IncompatibleSetupError", "PluginError",
                        "LaunchError"],
}

__all__ = sorted(name for names in _SOURCES.values() for name in names)
__getattr__, __dir__ = serve_names(__name__, _SOURCES)
