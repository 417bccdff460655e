"""Module paths of torchbay 0.1 that moved in the 0.2 layout: each still imports, for one release, with one warning.

``import torchbay.plugins`` (or ``from torchbay.strategy import Strategy``) finds the module at its new path and
serves it under the old name; the first use of each old path warns once with a :class:`DeprecationWarning` that
names the new one. Plugin authors import from :mod:`torchbay.plugin` instead (docs/writing-plugins.md). Nothing
is imported until an old path is asked for, so ``import torchbay`` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

MOVED = {
    # 0.2's own paths that moved to keep folders in one layer (issue 37): documented for plugin authors or imported
    # by plugins' tests
    'torchbay.checkpoint.full_state': 'torchbay.axes.full_state',
    'torchbay.checkpoint.safe_load': 'torchbay.storage.safe_load',
    'torchbay.config.resolve': 'torchbay.registry.resolve',
    # the plugin machinery left the plugin-author façade for a folder of its own (issue 37)
    'torchbay.plugin.api_version': 'torchbay.registry.api_version',
    'torchbay.plugin.contributions': 'torchbay.registry.contributions',
    'torchbay.plugin.fragments': 'torchbay.registry.fragments',
    'torchbay.plugin.info': 'torchbay.registry.info',
    'torchbay.plugin.lazy_class': 'torchbay.registry.lazy_class',
    'torchbay.plugin.manager': 'torchbay.registry.manager',
    'torchbay.plugin.published': 'torchbay.registry.published',
    'torchbay.plugin.resolve': 'torchbay.registry.resolve',
    'torchbay.plugin.selection': 'torchbay.registry.selection',
    # the torchbay_as_accelerate.pth an earlier install left in site-packages imports it at every interpreter start
    'torchbay.compat.finder': 'torchbay.switch.finder',
    # torchbay 0.1's paths
    'torchbay.accelerate_import': 'torchbay.compat.config_import',
    'torchbay.accelerator_args': 'torchbay.accelerator.surface',
    'torchbay.accelerator_prepare': 'torchbay.accelerator.prepare',
    'torchbay.accelerator_process': 'torchbay.accelerator.process',
    'torchbay.accelerator_tracking': 'torchbay.accelerator.tracking',
    'torchbay.big_model_utils': 'torchbay.big_modeling.offload',
    'torchbay.checkpoint_dir': 'torchbay.storage.publish',
    'torchbay.checkpoint_files': 'torchbay.big_modeling.files',
    'torchbay.checkpoint_inplace': 'torchbay.storage.inplace',
    'torchbay.checkpoint_io': 'torchbay.axes.checkpoint_io',
    'torchbay.checkpoint_loading': 'torchbay.big_modeling.loading',
    'torchbay.checkpointing': 'torchbay.checkpoint.checkpointer',
    'torchbay.cli._options': 'torchbay.cli.options',
    'torchbay.cli._worker': 'torchbay.launch.worker',
    'torchbay.cluster': 'torchbay.axes.cluster',
    'torchbay.compat_names': 'torchbay.compat.names',
    'torchbay.config_files': 'torchbay.config.files',
    'torchbay.context': 'torchbay.axes.context',
    'torchbay.data_dispatch': 'torchbay.data.dispatch',
    'torchbay.data_sharding': 'torchbay.data.sharding',
    'torchbay.device': 'torchbay.axes.device',
    'torchbay.device_map': 'torchbay.big_modeling.device_map',
    'torchbay.device_map_infer': 'torchbay.big_modeling.infer',
    'torchbay.dispatch_hooks': 'torchbay.big_modeling.hooks',
    'torchbay.failures': 'torchbay.launch.failures',
    'torchbay.helpers': 'torchbay.compat.helpers',
    'torchbay.hook_placement': 'torchbay.big_modeling.hook_placement',
    'torchbay.kwargs': 'torchbay.config.handlers',
    'torchbay.launch_run': 'torchbay.launch.run',
    'torchbay.launcher': 'torchbay.launch.plan',
    'torchbay.offload_index': 'torchbay.big_modeling.offload_index',
    'torchbay.operations': 'torchbay.data.operations',
    'torchbay.parallelism_config': 'torchbay.distributed.parallelism_config',
    'torchbay.plugin_contributions': 'torchbay.registry.contributions',
    'torchbay.plugins': 'torchbay.registry.manager',
    'torchbay.precision': 'torchbay.axes.precision',
    'torchbay.progress': 'torchbay.tracking.progress',
    'torchbay.published': 'torchbay.registry.published',
    'torchbay.rng_state': 'torchbay.distributed.rng',
    'torchbay.safe_load': 'torchbay.storage.safe_load',
    'torchbay.selection': 'torchbay.registry.selection',
    'torchbay.strategy': 'torchbay.axes.strategy',
    'torchbay.tracking_jsonl': 'torchbay.tracking.jsonl',
    'torchbay.tracking_values': 'torchbay.tracking.values',
}

_warned: set[str] = set()


class _Alias:
    """The loader of an old path: the module at its new path (a loader needs only these two methods; not deriving
    from ``importlib.abc`` keeps ``import torchbay`` from importing ``importlib.resources`` and what it needs)."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec):
        if spec.name not in _warned:
            _warned.add(spec.name)
            warnings.warn(f"{spec.name} moved to {self.new_name} in torchbay 0.2; the old path goes in 0.3 "
                          f"(plugin authors: import from torchbay.plugin)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new_name)  # the module itself: one object under both names

    def exec_module(self, module) -> None:
        pass


class MovedModuleFinder:
    """Answers only the old paths in :data:`MOVED`; every other import passes by."""

    def find_spec(self, fullname, path=None, target=None):
        new_name = MOVED.get(fullname)
        return None if new_name is None else importlib.util.spec_from_loader(fullname, _Alias(new_name))


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
