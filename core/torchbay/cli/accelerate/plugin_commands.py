"""The ``accelerate`` subcommands a plugin serves (``accelerate to-fsdp2``, ``accelerate tpu-config``...), and
Accelerate's modules of those commands under the switch.

A plugin declares each command it serves in its ``accelerate.yaml``::

    api:
      commands:
        to-fsdp2: {module: torchbay_fsdp.to_fsdp2}

``module`` runs the command (its ``main(argv) -> exit code``) and answers for Accelerate's module of that command
(:data:`torchbay.switch.finder.PLUGIN_COMMAND_MODULES`: ``from accelerate.commands.to_fsdp2 import
to_fsdp2_command`` reads the plugin's module). While no installed plugin serves the command, running it is a
:class:`~torchbay.errors.PluginError` naming the distribution to install (``resources/published_plugins.yaml``),
and the names of its Accelerate module import as placeholders whose use says the same.
"""

from __future__ import annotations

import importlib
from typing import Any

from torchbay.errors import PluginError
from torchbay.registry.published import ACCELERATE_COMMAND, distribution_for, published

#: what answers the names of a plugin command's Accelerate module while no plugin serves the command: the core's
#: Accelerate command module (its config-file readers), the rest being placeholders
UNSERVED_TARGET = "torchbay.cli.accelerate.commands"


def served() -> dict[str, dict[str, Any]]:
    """``{command: {"module": ...}}`` for every ``accelerate`` command an installed plugin serves."""
    from torchbay.compat.names import api_table

    return dict(api_table().get("commands") or {})


def known() -> list[str]:
    """The plugin commands installed here or published by torchbay (``accelerate COMMAND`` says what to install)."""
    return sorted(set(served()) | set(published(ACCELERATE_COMMAND)))


def missing_advice(command: str) -> str:
    distribution = distribution_for(ACCELERATE_COMMAND, command)
    if distribution is None:
        return f"no installed torchbay plugin serves `accelerate {command}` (`torchbay plugins` lists the installed)"
    return f"`accelerate {command}` comes from the {distribution} plugin, which is not loaded here: pip install " \
           f"{distribution} (`torchbay plugins` says why an installed one is not loaded)"


def accelerate_module_target(command: str) -> tuple[str, str | None]:
    """The module that answers Accelerate's module of ``command``, and why its names are placeholders when no
    plugin serves the command (None when one does)."""
    entry = served().get(command)
    if entry is None:
        return UNSERVED_TARGET, missing_advice(command)
    return entry["module"], None


def run(command: str, argv: list[str]) -> int:
    """``accelerate COMMAND ARGV`` served by the plugin that declares it: its exit code."""
    entry = served().get(command)
    if entry is None:
        raise PluginError(missing_advice(command))
    return int(importlib.import_module(entry["module"]).main(argv) or 0)
