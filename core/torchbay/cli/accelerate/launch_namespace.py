"""``accelerate launch``'s namespace (``accelerate.commands.launch.launch_command_parser()``), as a layer on the
one flag table that ``torchbay launch`` reads Accelerate's flags from.

The parser's attributes are Accelerate's (``multi_gpu``, ``use_fsdp``, ``num_processes``, ``debug``,
``training_script``...), and nothing here lists them: they are made, in this order (the first to give a name
keeps it), from

1. ``torchbay launch``'s own flags, each under Accelerate's spelling (``--num-processes`` is ``num_processes``);
2. the Accelerate tables (``resources/accelerate.yaml`` and each plugin's ``accelerate.yaml``): ``launch_switches``
   and the switches a published plugin serves (``--use_fsdp``), ``launch_values``, the keys of the nested configs
   (under Accelerate's flag for each: ``flag_prefix``; Accelerate's default: ``flag_default``), then the
   Accelerate keys torchbay refuses (``launch_refused``, ``not_imported``: a switch when the key's ``no_effect``
   values are booleans; a key whose values are mappings or lists is a nested config, not a flag).

Every flag is spelled with underscores or hyphens, as Accelerate's are, and the attributes given on the command line
are recorded in ``nondefault``, as Accelerate records them. :func:`launch_tokens` turns a namespace back into the
``accelerate launch`` arguments it stands for, which ``torchbay launch`` reads as it reads them from a command
line (cli/accelerate_flags.py): a flag means the same whichever way it arrives.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Iterator

DESCRIPTION = ("Run a script in every process of the job, as `accelerate launch` does (served by torchbay launch, "
               "its workers answering `import accelerate`). Every flag may be written with hyphens too: "
               "--num-processes 2 is --num_processes 2.")
USAGE = "accelerate launch [options] [-m] training_script [training_script_args ...]"
#: the namespace attribute naming what ``_validate_launch_command`` filled in from a config file (not given)
FILLED = "_from_config_file"


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    """``base``, also recording its destination in ``namespace.nondefault`` (Accelerate's record of the given)."""

    class Recording(base):  # type: ignore[valid-type, misc]
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            given = getattr(namespace, "nondefault", None)
            if not isinstance(given, set):
                given = namespace.nondefault = set()
            given.add(self.dest)

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


#: the kinds of flag, each recording what was given (``boolean``: ``--x`` / ``--no-x``)
ACTIONS = {"switch": _recording(argparse._StoreTrueAction), "value": _recording(argparse._StoreAction),
           "append": _recording(argparse._AppendAction), "extend": _recording(argparse._ExtendAction),
           "boolean": _recording(argparse.BooleanOptionalAction)}


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag shown once, with Accelerate's spelling (the hyphenated one is accepted, not listed)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = ", ".join(o for o in action.option_strings if not o.startswith("--") or "-" not in o[2:])
        if action.nargs == 0:
            return shown
        return f"{shown} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


class AccelerateLaunchParser(argparse.ArgumentParser):
    """``accelerate launch``'s parser; an unknown flag is one line with the nearest known one."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace = argparse.Namespace() if namespace is None else namespace
        if not isinstance(getattr(namespace, "nondefault", None), set):
            namespace.nondefault = set()
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            from torchbay.cli.accelerate_flags import unknown_option_message

            self.error(unknown_option_message(self, unknown))
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see accelerate launch --help)\n")


def build_launch_parser() -> AccelerateLaunchParser:
    """The parser, made from ``torchbay launch``'s flags and the Accelerate tables (see the module's docstring)."""
    from torchbay.cli.main import _subparser, build_parser
    from torchbay.compat.config_import import mapping_table

    launch = _subparser(build_parser(), "launch")
    parser = AccelerateLaunchParser(prog="accelerate launch (served by torchbay)", usage=USAGE,
                                    description=DESCRIPTION, add_help=False, allow_abbrev=False,
                                    formatter_class=_HelpFormatter)
    parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
    named: set[str] = set()
    for name, shorts, kind, settings in [*_torchbay_flags(launch), *_table_flags(mapping_table(), launch)]:
        if name in named:
            continue
        named.add(name)
        dashed = "--" + name.replace("_", "-")
        spellings = [f"--{name}", *([dashed] if dashed != f"--{name}" else []), *shorts]
        settings.setdefault("default", False if kind == "switch" else None)
        parser.add_argument(*spellings, dest=name, action=ACTIONS[kind], **settings)
    for action in parser._actions:  # the help names each flag as the list does (torchrun's take both spellings)
        action.help = _spelled(action.help, named)
    parser.add_argument("training_script", action=ACTIONS["value"],
                        help="the script to run in every process (a module with -m)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, action=ACTIONS["value"],
                        help="the script's own arguments")
    return parser


def _spelled(text: str | None, named: set[str]) -> str | None:
    """``text`` with every ``--a-b`` that is a flag here written ``--a_b``, as the flags are listed."""
    import re

    if not text:
        return text
    return re.sub(r"--([a-z0-9]+(?:-[a-z0-9]+)+)",
                  lambda m: "--" + m.group(1).replace("-", "_") if m.group(1).replace("-", "_") in named
                  else m.group(0), text)


def _value_type(action: argparse.Action | None) -> Any:
    """int or float for a torchbay flag whose config key holds one (Accelerate's namespace holds numbers there)."""
    from torchbay.cli.options import ANNOTATION_ATTR

    annotation = getattr(action, ANNOTATION_ATTR, None)
    inner = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if len(inner) == 1 and inner[0] in (int, float):
        return inner[0]
    return getattr(action, "type", None)


def _torchbay_flags(launch: argparse.ArgumentParser) -> Iterator[tuple[str, list[str], str, dict[str, Any]]]:
    """``(name, short spellings, kind, add_argument settings)`` for each of ``torchbay launch``'s own flags."""
    for action in launch._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or isinstance(action, argparse._HelpAction):
            continue
        name = longs[0][2:].replace("-", "_")
        shorts = [o for o in action.option_strings if not o.startswith("--")]
        settings: dict[str, Any] = {"help": action.help}
        if isinstance(action, argparse.BooleanOptionalAction):
            kind = "boolean"
        elif action.nargs == 0:
            kind = "switch"
        elif isinstance(action, (argparse._ExtendAction, argparse._AppendAction)):
            kind = "extend" if isinstance(action, argparse._ExtendAction) else "append"
            settings.update(type=action.type, metavar=action.metavar)
        else:
            kind = "value"
            settings.update(nargs=action.nargs, const=action.const, choices=action.choices,
                            type=_value_type(action), metavar=action.metavar)
        yield name, shorts, kind, settings


def _table_flags(table: dict[str, Any], launch: argparse.ArgumentParser
                 ) -> Iterator[tuple[str, list[str], str, dict[str, Any]]]:
    """The Accelerate flags the tables name, in the order of the module's docstring."""
    from torchbay.compat.config_import import flag_of
    from torchbay.registry.published import LAUNCH_SWITCH, published

    def said(text: str) -> str:
        return " ".join(str(text).split()).replace("%", "%%")

    for name, meaning in (table.get("launch_switches") or {}).items():
        chosen = f"distributed_type {meaning}" if isinstance(meaning, str) else \
            ", ".join(f"{k}={v}" for k, v in (meaning or {}).items()) or "the flags that go with it"
        yield name, [], "switch", {"help": said(f"Accelerate's switch: sets {chosen}")}
    for name, distribution in published(LAUNCH_SWITCH).items():  # a plugin's, which is not installed
        yield name, [], "switch", {"help": said(f"Accelerate's switch, served once {distribution} is installed")}
    dests = getattr(launch, "_torchbay_config_dests", {})
    by_flag = {o: a for a in launch._actions for o in a.option_strings}
    for name, dotted in (table.get("launch_values") or {}).items():
        yield name, [], "value", {"type": _value_type(by_flag.get(dests.get(dotted, ""))),
                                  "help": said(f"Accelerate's flag: sets {dotted}")}
    for section, spec in (table.get("sections") or {}).items():
        for key, rule in (spec.get("keys") or {}).items() if "target" in spec else ():
            settings = {"help": said(f"what {section}.{key} means in an Accelerate config file")}
            if "flag_default" in rule:
                settings["default"] = rule["flag_default"]
            yield flag_of(spec, key), [], "switch" if rule.get("switch") else "value", settings
    no_effect = table.get("no_effect") or {}
    for key, reason in {**(table.get("not_imported") or {}), **(table.get("launch_refused") or {})}.items():
        values = (no_effect.get(key) or {}).get("values") or []
        if any(isinstance(v, (dict, list)) for v in values):
            continue  # a nested config or a list of the config file, not a flag
        kind = "switch" if any(isinstance(v, bool) for v in values) else "value"
        yield key, [], kind, {"help": said(f"refused by torchbay launch: {reason}")}


def launch_tokens(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The ``accelerate launch`` arguments ``args`` stands for: each flag given on the command line or changed
    since (not the values ``_validate_launch_command`` took from a config file), then the script and its
    arguments."""
    given = getattr(args, "nondefault", None) or set()
    filled = getattr(args, FILLED, None) or set()
    tokens: list[str] = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction) or action.dest in filled:
            continue
        value = getattr(args, action.dest, action.default)
        if value is None or (action.dest not in given and value == action.default):
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            tokens.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:
            tokens += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):  # (extend too)
            tokens += [f"{flag}={item}" for item in value]
        else:
            tokens.append(f"{flag}={value}")
    script = getattr(args, "training_script", None)
    return tokens + ([script] if script else []) + list(getattr(args, "training_script_args", None) or [])
