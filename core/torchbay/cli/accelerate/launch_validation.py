"""``accelerate.commands.launch._validate_launch_command``: an ``accelerate launch`` namespace completed from the
Accelerate config file the launch reads, as Accelerate completes it, so that code reading the namespace sees what
it would see on Accelerate.

- The config file is ``--config_file``, else Accelerate's default one when it exists and neither ``--cpu`` nor a
  torchbay config (``TORCHBAY_CONFIG_FILE``, ``./torchbay.yaml``) says otherwise; a torchbay config file is not
  Accelerate's and completes nothing. A key neither Accelerate nor torchbay knows is refused, as Accelerate
  refuses it.
- No set-up switch given: the switches that choose the file's ``distributed_type`` are set, read from the tables
  (``launch_switches``): the switch that names the type, else the one switch whose settings the type's contain
  (MULTI_GPU contains ``--multi_gpu``'s; MULTI_CPU contains ``--cpu``'s and ``--multi_gpu``'s, so neither).
- Every other setting of the file fills the attribute of the same name that the command line did not give; a
  nested config's keys fill the attributes of their flags (``fsdp_config.fsdp_sync_module_states``).
- Without a config file, the process count is this machine's devices (one on a CPU-only machine).

What was filled is recorded on the namespace, so that ``launch_command`` still gives ``torchbay launch`` only what
the command line gave (torchbay imports the config file itself).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from torchbay.cli.accelerate.launch_namespace import FILLED
from torchbay.errors import ConfigError

#: settings of the file that are no attribute of the namespace (the switches stand for distributed_type)
NOT_ATTRIBUTES = ("compute_environment", "distributed_type")


def accelerate_config_in_use(args: argparse.Namespace) -> str | None:
    """The Accelerate config file a launch of ``args`` reads (None: none, or a torchbay config file)."""
    from torchbay.cli.options import DEFAULT_CONFIG_FILE
    from torchbay.compat.accelerate_config_file import default_config_file, load_config_from_file
    from torchbay.config.files import CONFIG_FILE_ENV

    path = getattr(args, "config_file", None)
    if path is None:
        if getattr(args, "cpu", False) or os.environ.get(CONFIG_FILE_ENV) or os.path.isfile(DEFAULT_CONFIG_FILE) \
                or not os.path.isfile(default_config_file):
            return None
        path = default_config_file
    settings = load_config_from_file(path).to_dict()
    return path if "distributed_type" in settings or "compute_environment" in settings else None


def validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, bool]:
    """``(args, the config file's settings or None, whether mixed_precision came from the file)``; ``args`` is
    completed in place (see the module's docstring)."""
    from torchbay.compat.accelerate_config_file import load_config_from_file
    from torchbay.compat.config_import import flag_of, mapping_table

    table = mapping_table()
    switches = table.get("launch_switches") or {}
    given = getattr(args, "nondefault", None) or set()
    _refuse_conflicting_switches(args, switches, table)
    filled: set[str] = set(getattr(args, FILLED, None) or ())

    def fill(name: str, value: Any) -> None:
        setattr(args, name, value)
        filled.add(name)

    path = accelerate_config_in_use(args)
    defaults = load_config_from_file(path) if path else None
    mixed_from_file = False
    if defaults is not None:
        settings = defaults.to_dict()
        _refuse_unknown_keys(settings, path, table)
        if not any(getattr(args, name, False) for name in switches):
            for name in switches_for(settings.get("distributed_type", "NO"), table):
                fill(name, True)
        mixed_from_file = "mixed_precision" not in given and getattr(args, "mixed_precision", None) is None \
            and settings.get("mixed_precision") is not None
        for key, value in settings.items():
            if isinstance(value, dict):
                spec = (table.get("sections") or {}).get(key) or {}
                for sub, sub_value in value.items():
                    if flag_of(spec, sub) not in given:
                        fill(flag_of(spec, sub), sub_value)
            elif key not in NOT_ATTRIBUTES and key not in given and _unset(getattr(args, key, None)):
                fill(key, value)
    elif getattr(args, "num_processes", None) is None:
        from torchbay.cli.accelerate.launch_helpers import _machine_layout

        layout = _machine_layout()
        fill("num_processes", layout["num_processes"])
        if not any(getattr(args, name, False) for name in switches):
            for name in switches_for(layout["distributed_type"], table):
                fill(name, True)
    for name, value in (("num_machines", 1), ("mixed_precision", "no"), ("gpu_ids", "all"),
                        ("dynamo_backend", "no"), ("debug", False)):
        if getattr(args, name, None) is None:
            fill(name, value)
    if getattr(args, "use_cpu", None) is None:
        fill("use_cpu", bool(getattr(args, "cpu", False)))
    setattr(args, FILLED, filled - given)
    return args, defaults, mixed_from_file


def _unset(value: Any) -> bool:
    """An attribute the file may fill: absent, or a flag's default (None, or a switch not given)."""
    return value is None or value is False


def switches_for(distributed_type: Any, table: dict[str, Any]) -> list[str]:
    """The ``accelerate launch`` switches that stand for ``distributed_type`` (see the module's docstring)."""
    switches = table.get("launch_switches") or {}
    named = [name for name, meaning in switches.items() if isinstance(meaning, str) and meaning == distributed_type]
    if named:
        return named
    settings = (table.get("distributed_type") or {}).get(str(distributed_type)) or {}
    contained = [name for name, meaning in switches.items() if isinstance(meaning, dict) and meaning
                 and all(settings.get(key) == value for key, value in meaning.items())]
    return contained if len(contained) == 1 else []


def _settings_of(meaning: Any, table: dict[str, Any]) -> dict[str, Any]:
    if isinstance(meaning, str):
        return (table.get("distributed_type") or {}).get(meaning) or {"distributed_type": meaning}
    return dict(meaning or {})


def _refuse_conflicting_switches(args: argparse.Namespace, switches: dict[str, Any], table: dict[str, Any]) -> None:
    """Two switches given that set the same setting differently (``--multi_gpu --use_fsdp``) are refused."""
    chosen: dict[str, tuple[Any, str]] = {}
    for name, meaning in switches.items():
        if not getattr(args, name, False):
            continue
        for key, value in _settings_of(meaning, table).items():
            earlier = chosen.setdefault(key, (value, name))
            if earlier[0] != value:
                raise ConfigError(f"--{earlier[1]} and --{name} choose different set-ups ({key} {earlier[0]} and "
                                  f"{value}): give one of them", header="accelerate launch")


def _refuse_unknown_keys(settings: dict[str, Any], path: str, table: dict[str, Any]) -> None:
    """A key of an Accelerate config that neither torchbay nor an installed plugin knows: Accelerate refuses the
    file, and so does ``accelerate launch`` here (a SageMaker config, which Accelerate reads with other keys, is
    left to the launch, which refuses SageMaker)."""
    from torchbay.compat.config_import import UNKNOWN_KEY, convert

    if settings.get("compute_environment", "LOCAL_MACHINE") not in (table.get("compute_environment") or {}):
        return
    _, report = convert(settings)
    unknown = sorted(key for key, _, why in report.not_imported if why == UNKNOWN_KEY)
    if unknown:
        raise ConfigError(f"the config file at {path} had unknown keys ({', '.join(unknown)}): neither Accelerate "
                          "nor torchbay reads them; remove them (`torchbay config import-accelerate FILE` shows how "
                          "torchbay reads each key)", header="accelerate launch")
