"""Command-line flags for every core setting, plugin flags, and turning them into the "cli" source.

Flags are generated from the config model, so a new core setting gets its flag for free:
top-level keys and the ``launch`` section use their own name (``--mixed-precision``,
``--num-processes``), other sections are prefixed (``--dataloader-split-batches``,
``--checkpoint-io``). ``--set KEY=VALUE`` sets any key, plugin sections included. Plugins add
their own flags through ``torchbay_add_cli_options`` with ``dest="<section>.<key>"``, or get
flags generated the same way for their whole section with :func:`add_section_options`
(``--<section>-<key>``, e.g. ``--fp8-backend`` from the FP8 plugins' section).
Every flag's value is validated by the config model, so a bad value is reported with the
flag that set it, like any other config error.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Mapping

from torchbay.errors import ConfigError

#: sections whose keys get no prefix on the command line
UNPREFIXED = ("launch", "tracking")  # --log-with, --logging-dir
#: keys with no flag of their own (use --set)
NO_FLAG: set[str] = {"compile.options",  # a mapping: --set compile.options.<key>=VALUE
                     "launch.as_accelerate"}  # a plain switch of `torchbay launch` (cli/launch.py)
CONFIG_DESTS_ATTR = "_torchbay_config_dests"
#: attribute of a generated flag's argparse action: the config field's annotation
ANNOTATION_ATTR = "torchbay_annotation"
#: the file `torchbay config` writes, read by the commands from the working directory when no
#: config file is named (as `accelerate launch` reads Accelerate's default config file)
DEFAULT_CONFIG_FILE = "torchbay.yaml"


def _is_section(annotation: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _kind(annotation: Any) -> str:
    """``bool``, ``list``, ``optional`` or ``value`` for a field annotation."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return "bool"
    if origin is list:
        return "list"
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return "optional-bool" if inner == [bool] else "optional"
    return "value"


def _literal_values(annotation: Any) -> set[Any]:
    """The values a ``Literal[...]`` (or ``Optional[Literal[...]]``) annotation allows; empty for other types."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    return {value for arg in typing.get_args(annotation) for value in _literal_values(arg)}


def flag_name(section: str | None, key: str) -> str:
    if section is None or section in UNPREFIXED or key.startswith(section):
        name = key
    else:
        name = f"{section}_{key}"
    return "--" + name.replace("_", "-")


def core_flags() -> list[tuple[str, str, Any, str]]:
    """``(flag, dotted key, annotation, help)`` for every core setting."""
    from torchbay.config.model import CoreConfig

    out = []
    for key, field in CoreConfig.model_fields.items():
        if _is_section(field.annotation):
            for sub, subfield in field.annotation.model_fields.items():
                dotted = f"{key}.{sub}"
                if dotted not in NO_FLAG:
                    out.append((flag_name(key, sub), dotted, subfield.annotation, subfield.description or ""))
        else:
            out.append((flag_name(None, key), key, field.annotation, field.description or ""))
    return out


def _comma_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _add_flag(container, flag: str, dotted: str, annotation: Any, help_text: str,
              overrides: Mapping[str, Any] | None = None) -> argparse.Action:
    """One generated flag for the config key ``dotted`` (bools take an optional value, lists repeat);
    ``overrides`` are argparse keywords that replace the generated ones (an ``action`` replaces the
    value handling altogether)."""
    kind = _kind(annotation)
    kwargs: dict[str, Any] = {"dest": dotted, "default": argparse.SUPPRESS,
                              "help": help_text.replace("%", "%%") or None}
    if kind in ("bool", "optional-bool"):
        kwargs.update(nargs="?", const="true", metavar="BOOL")
    elif kind == "list":  # --x a,b --x c -> [a, b, c]
        kwargs.update(action="extend", type=_comma_list, metavar="VALUE")
    else:
        kwargs["metavar"] = dotted.rpartition(".")[2].upper()
    overrides = overrides or {}
    if "action" in overrides or "choices" in overrides:  # the override handles the value: drop the generated way
        for generated in ("nargs", "const", "metavar", "action", "type"):
            kwargs.pop(generated, None)
    kwargs.update(overrides)
    action = container.add_argument(flag, **kwargs)
    setattr(action, ANNOTATION_ATTR, annotation)
    return action


def add_section_options(container, section: str, model: Any, skip: set[str] | frozenset[str] = frozenset(),
                        flags: Mapping[str, tuple[str, Mapping[str, Any]]] | None = None) -> None:
    """Add a ``--<section>-<key>`` flag for every key of a plugin's config section ``model``
    (but those in ``skip``), parsed like the core's own flags (``parser`` or an argument group).

    ``flags`` (``{flag: (key, argparse keywords)}``) instead adds only those keys, under those
    spellings (e.g. Accelerate's ``--zero-stage``), with the keywords (``type``, ``choices``,
    ``action``, ``help``...) on top of the generated ones. Called from a plugin's
    ``torchbay_add_cli_options``; values set this way are validated by the config model and
    reported with the flag, like every other flag.
    """
    if flags is None:
        flags = {flag_name(section, key): (key, {}) for key in model.model_fields if key not in skip}
    for flag, (key, overrides) in flags.items():
        field = model.model_fields[key]
        _add_flag(container, flag, f"{section}.{key}", field.annotation, field.description or "", overrides)


def add_config_options(parser: argparse.ArgumentParser, command: str, pm=None,
                       core_keys: typing.Collection[str] | None = None) -> None:
    """Add ``--config-file``, a flag per core setting (or per key of ``core_keys``: the ones the
    command uses; ``--set`` still sets any), ``--set`` and the plugins' flags."""
    dests: dict[str, str] = {}
    parser.add_argument("--config-file", metavar="FILE", default=None,
                        help=f"YAML config file (default: $TORCHBAY_CONFIG_FILE, else ./{DEFAULT_CONFIG_FILE} when "
                             f"there is one, as `torchbay config` writes it)")
    group = parser.add_argument_group("settings (each overrides the config file and TORCHBAY_* variables)")
    for flag, dotted, annotation, help_text in core_flags():
        if core_keys is not None and dotted not in core_keys:
            continue
        _add_flag(group, flag, dotted, annotation, help_text)
        dests[dotted] = flag
    group.add_argument("--set", dest="_set", action="append", default=[], metavar="KEY=VALUE",
                       help="set any key, plugin sections included (value is YAML): --set fsdp_like.key=true")
    if pm is None:
        from torchbay.registry.manager import get_plugin_manager

        pm = get_plugin_manager()
    before = {id(a) for a in parser._actions}
    pm.hook.torchbay_add_cli_options.call_historic(kwargs={"parser": parser, "command": command})
    for action in parser._actions:
        if id(action) not in before and action.dest and action.dest != argparse.SUPPRESS:
            action.default = argparse.SUPPRESS  # only flags actually given count as the "cli" source
            dests[action.dest] = (action.option_strings or [action.dest])[0]
    annotations = {a.dest: getattr(a, ANNOTATION_ATTR) for a in parser._actions if hasattr(a, ANNOTATION_ATTR)}
    setattr(parser, CONFIG_DESTS_ATTR, dests)
    parser.set_defaults(_config_dests=dests, _config_annotations=annotations)


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config values given on the command line, as ``{dotted: value}``."""
    import yaml

    dests: dict[str, str] = getattr(args, "_config_dests", {})
    annotations = getattr(args, "_config_annotations", None)
    if annotations is None:
        annotations = {dotted: annotation for _, dotted, annotation, _ in core_flags()}
    out: dict[str, Any] = {}
    for dotted in dests:
        if not hasattr(args, dotted):
            continue
        value = getattr(args, dotted)
        kind = _kind(annotations[dotted]) if dotted in annotations else "value"
        if kind.startswith("optional") and isinstance(value, str) and value.lower() in ("none", "null", "") \
                and value not in _literal_values(annotations.get(dotted)):  # "none" may be a choice of its own
            value = None
        if kind == "list" and isinstance(value, list):
            value = [part for item in value for part in str(item).split(",") if part]
        out[dotted] = value
    problems = []
    set_keys = []
    for item in getattr(args, "_set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE, e.g. --set dataloader.even_batches=false")
            continue
        set_keys.append(key.strip())
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = raw
    if problems:
        raise ConfigError(problems)
    args._set_keys = set_keys
    return out


def resolve_from_args(args: argparse.Namespace, pm=None, environ=None):
    """Resolve the config from ``--config-file``, the environment and the flags in ``args``."""
    import os

    from torchbay.config.files import CONFIG_FILE_ENV
    from torchbay.config.model import RESOLVED_ENV
    from torchbay.registry.resolve import resolve_config

    environ = dict(os.environ if environ is None else environ)
    environ.pop(RESOLVED_ENV, None)  # a launcher resolves afresh, even inside another job
    if getattr(args, "config_file", None) is None and not environ.get(CONFIG_FILE_ENV) and \
            os.path.isfile(DEFAULT_CONFIG_FILE):
        args.config_file = DEFAULT_CONFIG_FILE
        args.config_file_found = True  # (the plan line says where it came from)
    return resolve_config(file=getattr(args, "config_file", None), environ=environ, cli=cli_values(args), pm=pm)


def flag_for(args: argparse.Namespace, dotted: str) -> str:
    """The flag that set ``dotted`` (for messages): the ``accelerate launch`` flag read for it, its own flag, or
    ``--set``."""
    origins = getattr(args, "_flag_origins", None) or {}
    if dotted in origins:
        return origins[dotted]
    if any(dotted == k or dotted.startswith(k + ".") for k in getattr(args, "_set_keys", [])):
        return f"--set {dotted}=..."
    return getattr(args, "_config_dests", {}).get(dotted, f"--set {dotted}=...")
