"""The version of the plugin contract, and what a plugin's declared version means at discovery.

The contract is what :mod:`torchbay.plugin` exports and :mod:`torchbay.hookspecs` specifies. Its version moves
independently of torchbay's release number: the major when a name or hook a plugin may use changes or goes, the
minor when one is added. A plugin states the version it was written for in its entry-point module::

    TORCHBAY_PLUGIN_API = (1, 0)

At discovery a different major is refused (the plugin is not loaded; the run goes on without it), a newer minor
is loaded with a warning (it may use a hook or name this torchbay lacks), and an older minor or no declaration
is loaded silently.

History: 1.0 (round 3); 1.1 adds :class:`~torchbay.plugin.LazyClass` (a registration hook may name a class by its
import path, so that a run that does not select it never imports it), ``StagingBuffer`` (the host copy an
asynchronous save reuses) and ``Strategy.release_checkpoint_staging``; 1.2 adds ``load_config_from_file`` and
``default_config_file`` (Accelerate's config files as torchbay reads them, for an ``accelerate`` command a plugin
serves: its accelerate.yaml's ``api: commands``); 1.3 adds ``DeviceBackend.peak_flops(dtype)`` (the device's published
peak, for telemetry's MFU; the base answers ``None``, unknown) and what a strategy that builds the mesh checks
(``parallel_sizes``, the pipeline's ``SCHEDULES`` and ``check_pipeline``, Ulysses' ``SP_ATTN_IMPLEMENTATIONS``).
"""

from __future__ import annotations

from typing import Any

#: (major, minor) of the plugin contract this torchbay implements
API_VERSION = (1, 3)
#: the module attribute a plugin declares its version in
DECLARATION = "TORCHBAY_PLUGIN_API"


def declared_version(plugin: Any) -> tuple[int, int] | None:
    """The ``(major, minor)`` a plugin module declares, None when it declares nothing.

    A malformed declaration is a ValueError naming the attribute and the expected form."""
    value = getattr(plugin, DECLARATION, None)
    if value is None:
        return None
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(part, int) and not isinstance(part, bool) for part in value)):
        raise ValueError(f"{DECLARATION} = {value!r} is not a version: write {DECLARATION} = (major, minor), "
                         f"e.g. {API_VERSION!r}")
    return int(value[0]), int(value[1])


def show(version: tuple[int, int] | None) -> str:
    return "-" if version is None else f"{version[0]}.{version[1]}"


def verdict(name: str, distribution: str, version: tuple[int, int] | None) -> tuple[str, str]:
    """``("refuse" | "warn" | "ok", message)`` for a plugin that declares ``version``."""
    if version is None:
        return "ok", ""
    ours = show(API_VERSION)
    if version[0] != API_VERSION[0]:
        newer = version[0] > API_VERSION[0]
        fix = (f"upgrade torchbay to one that implements plugin API {version[0]}.x" if newer
               else f"install a {distribution} release written for plugin API {API_VERSION[0]}.x")
        return "refuse", (f"plugin '{name}' (distribution {distribution}) was written for torchbay plugin API "
                          f"{show(version)}, this torchbay implements {ours}: it is not loaded ({fix}, or "
                          f"pip uninstall {distribution})")
    if version[1] > API_VERSION[1]:
        return "warn", (f"plugin '{name}' (distribution {distribution}) was written for torchbay plugin API "
                        f"{show(version)}, newer than this torchbay's {ours}: it is loaded, but may use hooks or "
                        f"names this torchbay lacks (upgrade torchbay)")
    return "ok", ""
