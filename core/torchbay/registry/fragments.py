"""A plugin's part of the Accelerate compatibility tables: the ``accelerate.yaml`` in its package.

The plugin manager reads it for every plugin that has one (:meth:`~torchbay.registry.contributions.Contributions.
accelerate_mapping`); a plugin implements the hook ``torchbay_accelerate_mapping`` only to compute its fragment.
"""

from __future__ import annotations

import functools
import importlib.resources
import types
from typing import Any

from torchbay.config.files import read_packaged_yaml

#: the file, in a plugin's package, that holds its Accelerate mapping fragment
FRAGMENT_FILE = "accelerate.yaml"


@functools.lru_cache(maxsize=None)
def read_fragment(package: str, resource: str = FRAGMENT_FILE) -> dict[str, Any]:
    """The YAML file ``resource`` in ``package``: a mapping whose keys are ``config_import`` and/or ``api``.

    Read once per process, and only when the Accelerate import or an Accelerate name needs it. Callers must not
    change the returned mapping (it is shared). A malformed file raises ``ValueError``, which disables the plugin
    for the run with a warning naming the file.
    """
    data = read_packaged_yaml(package, resource) or {}
    if not isinstance(data, dict) or not set(data) <= {"config_import", "api"}:
        raise ValueError(f"{package}/{resource} is not an Accelerate mapping fragment: make it a mapping whose "
                         f"keys are config_import and/or api "
                         f"(found {sorted(data) if isinstance(data, dict) else data!r})")
    return data


def package_of(plugin: Any) -> str | None:
    """The package a registered plugin (a module, or an object of a class) was loaded from, or None."""
    module = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__module__
    if isinstance(plugin, types.ModuleType) and getattr(plugin, "__path__", None) is not None:
        return module  # the plugin is a package itself
    package = module.rpartition(".")[0]
    return package or None


def fragment_file_of(plugin: Any) -> str | None:
    """``plugin``'s package when it holds an ``accelerate.yaml``, else None."""
    package = package_of(plugin)
    if package is None:
        return None
    try:
        found = importlib.resources.files(package).joinpath(FRAGMENT_FILE).is_file()
    except (ModuleNotFoundError, TypeError, ValueError):
        return None
    return package if found else None
