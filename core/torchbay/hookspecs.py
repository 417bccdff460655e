"""Every hook a torchbay plugin can implement.

A plugin is a module or object with functions named like the hooks below, decorated with
``torchbay.hookimpl``; it is found through the entry-point group ``torchbay`` (see
:mod:`torchbay.registry.manager`). The built-in plugins under ``torchbay.builtin`` use these same
hooks.

Hooks are for two things only:

- **discovery**: what is installed (devices, strategies, precisions, checkpoint io, cluster
  environments, experiment trackers, config sections, Accelerate compatibility data, CLI options and commands);
- **cross-cutting concerns** that do not belong to one selected object: checks of a
  plugin's own settings, extra state in a checkpoint, lines of ``torchbay env``.

Every per-run decision (launch environment, validation of the selected set-up, process
set-up, ``prepare``, every training step, checkpoints, memory estimates) is a method of the
selected :class:`~torchbay.plugin.DeviceBackend`, :class:`~torchbay.plugin.Strategy`,
:class:`~torchbay.plugin.Precision` or :class:`~torchbay.plugin.CheckpointIO`:
only the selected object runs it, so no plugin asks "am I the selected one?".
``docs/architecture.md`` draws the path from config to those objects.

Every ``torchbay_register_*`` hook may return, in place of a class,
``torchbay.plugin.LazyClass("package.module:Class", name=...)`` (plugin API 1.1): the registry
knows the name, and the class is imported only when a run selects it.

Unless a hook says "first result wins", pluggy calls every implementation and returns the
list of their non-``None`` results.

A third-party implementation that raises (anything but ``KeyboardInterrupt`` or a
:class:`~torchbay.errors.TorchbayError` raised on purpose) disables its plugin for the run
with one warning; a run that selected the plugin's device, strategy, precision or checkpoint
io stops with a :class:`~torchbay.errors.PluginError` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import argparse

    from pydantic import BaseModel

    from torchbay.axes.checkpoint_io import CheckpointIO
    from torchbay.axes.cluster import ClusterEnvironment
    from torchbay.axes.context import RunContext
    from torchbay.axes.device import DeviceBackend
    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import Strategy
    from torchbay.axes.tracker import GeneralTracker

hookspec = pluggy.HookspecMarker("torchbay")


# --- registries: collect-all, called once per process -------------------------------------


@hookspec
def torchbay_register_devices() -> list[type[DeviceBackend]]:
    """Return the device backend classes this plugin provides.

    Each class has a unique ``name`` (``config.device`` selects it) and a ``priority``
    (higher wins when ``device: auto`` picks among the available ones).

    :return: a list of :class:`~torchbay.plugin.DeviceBackend` subclasses.
    """


@hookspec
def torchbay_register_strategies() -> list[type[Strategy]]:
    """Return the strategy classes this plugin provides (selected by ``config.strategy``).

    :return: a list of :class:`~torchbay.plugin.Strategy` subclasses, each with a unique
        ``name``.
    """


@hookspec
def torchbay_register_precisions() -> list[type[Precision]]:
    """Return the precision classes this plugin provides.

    A class's ``name`` is the ``mixed_precision`` mode it serves (``no``, ``fp16``, ``bf16``,
    or a mode of the plugin's own). A mode several engines serve has one class per engine,
    with ``engine`` set to the ``<mode>.backend`` value it serves (``auto`` picks the
    available engine of highest ``priority``), e.g. FP8: ``name = "fp8"``, ``engine = "te"``.
    Classes are keyed by ``(name, engine)``.

    :return: a list of :class:`~torchbay.plugin.Precision` subclasses.
    """


@hookspec
def torchbay_register_checkpoint_io() -> list[type[CheckpointIO]]:
    """Return checkpoint-io classes (how tensors reach storage), each with a unique ``name``.

    ``config.checkpoint.io`` selects the one that writes model weights.

    :return: a list of :class:`~torchbay.plugin.CheckpointIO` subclasses.
    """


@hookspec
def torchbay_register_cluster_environments() -> list[type[ClusterEnvironment]]:
    """Return cluster-environment classes that tell rank, world size and rendezvous.

    The first class (by ``priority``, highest first) whose ``detect()`` is true describes
    the current process.

    :return: a list of :class:`~torchbay.plugin.ClusterEnvironment` subclasses.
    """


@hookspec
def torchbay_register_trackers() -> list[type[GeneralTracker]]:
    """Return the experiment-tracker classes this plugin provides (one per tracking library).

    Each class is a :class:`~torchbay.plugin.GeneralTracker` subclass with a unique
    ``name``; ``tracking.log_with`` (``Accelerator(log_with=...)``, ``--log-with``) selects
    trackers by name, ``"all"`` every installed one. Only the selected classes are asked
    anything (``unavailable_reason``, ``check``, ``logging_dir_for``, ``create``), so returning
    a class must not import the tracker's library. The tracker's own settings are the config
    section named after it, contributed through :func:`torchbay_config_sections`. The core
    registers the built-in ``jsonl`` tracker through this hook.

    :return: a list of :class:`~torchbay.plugin.GeneralTracker` subclasses.
    """


@hookspec
def torchbay_config_sections() -> dict[str, type[BaseModel]]:
    """Contribute configuration sections: ``{"section_name": PydanticModel}``.

    Each model should use ``extra="forbid"``; the section appears at the top level of the
    config tree (``mysection:`` in YAML, ``TORCHBAY_MYSECTION__KEY`` in the environment,
    ``Accelerator(config={"mysection": {...}})``). A section whose name is a core key or
    another plugin's section disables the plugin that returned it (see :mod:`torchbay.registry.manager`).

    :return: a mapping of section name to a pydantic model class with defaults.
    """


@hookspec
def torchbay_accelerate_mapping() -> dict[str, Any]:
    """Contribute this plugin's part of the Hugging Face Accelerate compatibility data.

    The core's tables hold only what concerns cpu, single, ddp and the generic keys; each
    plugin adds the Accelerate names it serves, in the same layout as the core's tables:
    under ``"config_import"`` (``torchbay/resources/accelerate.yaml``, read by ``torchbay
    config import-accelerate``) its ``distributed_type`` values, its nested config section
    (e.g. a strategy's ``<name>_config``), reasons for keys it cannot import; under ``"api"``
    (``accelerate_api.yaml``) its ``is_<name>_available`` entries, the Accelerate names it
    re-exports (``plugin_names``) or refuses (``unsupported``). Keep the data in a file
    ``accelerate.yaml`` inside the plugin's package: the plugin manager reads it for every plugin
    that has one, so a plugin implements this hook only when it computes its fragment (the hook's
    result then replaces the file).

    Called only when the import or an Accelerate name (``torchbay.utils.is_x_available``...)
    needs the tables, never at ``import torchbay`` or ``Accelerator()``. Fragments are merged
    into the core's tables key by key (lists are concatenated); a key the core or an earlier
    plugin already defines is a conflict that disables the later plugin, with a warning. An
    Accelerate value or key that no installed plugin maps is reported as not imported.

    :return: ``{"config_import": {...}, "api": {...}}`` (either part may be absent).
    """


# --- historic: replayed to plugins registered later ---------------------------------------


@hookspec(historic=True)
def torchbay_add_cli_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Add command-line options to the ``torchbay <command>`` parser.

    Options whose ``dest`` is ``"<section>.<key>"`` (e.g. ``dest="mysection.some_key"``)
    feed the config tree as the "cli" source. Historic.

    :param parser: the argparse parser of that command.
    :param command: the command whose parser this is: ``"launch"``, ``"test"`` or
        ``"estimate-memory"`` (``config show`` reads the ``"launch"`` options).
    """


@hookspec(historic=True)
def torchbay_add_commands(subparsers: Any) -> None:
    """Add ``torchbay`` subcommands (e.g. ``merge-weights``). Historic.

    :param subparsers: the ``argparse`` sub-parsers action of the ``torchbay`` command;
        call ``subparsers.add_parser(name, help=...)`` and ``set_defaults(func=callable)``
        where ``callable(args) -> int`` is the exit code.
    """


# --- cross-cutting: every plugin takes part ----------------------------------------------


@hookspec
def torchbay_validate(context: RunContext) -> list[str] | None:
    """Complain about the chosen set-up before any process group starts, from a plugin's
    own point of view (its own settings, a library version it needs).

    The selected device, strategy and precision check themselves in their ``check``
    classmethods; this hook is for plugins that are not one of them. Every plugin's complaints are
    collected and reported together in one
    :class:`~torchbay.errors.IncompatibleSetupError`.

    ``torchbay plugins`` and ``torchbay env`` call it too, once, with the configured set-up and
    no object created yet: a plugin that raises here is listed as failed there.

    :param context: the selected device, strategy, precision and config.
    :return: a list of problems, each naming the setting at fault and the fix; empty or
        ``None`` when all is well.
    """


@hookspec
def torchbay_state_extra(context: RunContext) -> dict[str, Any] | None:
    """Extra state a plugin wants in ``save_state`` (e.g. FP8 scaling history).

    :return: ``{"key": state}`` where state is made of tensors, numbers, strings, lists
        and dicts (loadable with ``weights_only=True``); keys must be unique across plugins.

    ``torchbay plugins`` and ``torchbay env`` call it too, once, outside any run
    (``context.strategy`` and the other instances are ``None``), to list a plugin that raises
    here as failed; return ``None`` when there is nothing to save yet.
    """


@hookspec
def torchbay_load_state_extra(context: RunContext, state: dict[str, Any]) -> None:
    """Restore what :func:`torchbay_state_extra` saved. ``state`` holds every plugin's keys.

    Raise :class:`~torchbay.errors.CheckpointError` when a key of this plugin is missing or
    cannot be restored; never only log it.
    """


@hookspec
def torchbay_report_env() -> dict[str, Any] | None:
    """Information for ``torchbay env``: backend library versions, devices found, why not.

    :return: a flat mapping of label to value.
    """
