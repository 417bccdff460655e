"""``torchbay config``: write, show, explain, validate and import configuration files."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any, Callable

from torchbay.cli.options import DEFAULT_CONFIG_FILE as DEFAULT_OUTPUT


def register(subparsers) -> None:
    from torchbay.cli.options import add_config_options

    parser = subparsers.add_parser(
        "config", help="write a config (questionnaire or --default), show, schema, validate, import-accelerate",
        description="Without a subcommand: ask the questions that the installed plugins make relevant "
                    "and write a YAML config (--default: write a sensible one without asking).")
    parser.add_argument("--default", action="store_true", help="write a sensible config without asking")
    parser.add_argument("-o", "--output", default=DEFAULT_OUTPUT, help=f"file to write (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    parser.set_defaults(func=questionnaire_command)
    sub = parser.add_subparsers(dest="config_command", metavar="SUBCOMMAND")

    show = sub.add_parser("show", help="print the resolved config (file < TORCHBAY_* env < flags)")
    add_config_options(show, "launch")
    show.add_argument("--sources", action="store_true", help="say where every value came from")
    show.add_argument("--format", choices=("yaml", "json"), default="yaml")
    show.set_defaults(func=show_command)

    schema = sub.add_parser("schema", help="print the JSON schema (core and every installed plugin's section)")
    schema.set_defaults(func=schema_command)

    validate = sub.add_parser("validate", help="check a config file and the set-up it describes")
    validate.add_argument("file", metavar="FILE")
    validate.set_defaults(func=validate_command)

    imp = sub.add_parser("import-accelerate", help="convert a Hugging Face Accelerate config YAML")
    imp.add_argument("file", metavar="FILE", help="e.g. ~/.cache/huggingface/accelerate/default_config.yaml")
    imp.add_argument("-o", "--output", help="write the torchbay config here (default: print it)")
    imp.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    imp.add_argument("--strict", action="store_true", help="exit 1 when a key could not be imported")
    imp.set_defaults(func=import_command)


# --- show / schema / validate ------------------------------------------------------------


def show_command(args: argparse.Namespace) -> int:
    import yaml

    from torchbay.cli.options import flag_for, resolve_from_args
    from torchbay.launch.plan import describe_source

    resolved = resolve_from_args(args)
    if args.format == "json":
        payload: dict[str, Any] = {"config": resolved.config.model_dump(mode="json")}
        if args.sources:
            payload["sources"] = {k: resolved.source_of(k) for k in resolved.flat()}
        print(json.dumps(payload, indent=2))
        return 0
    if not args.sources:
        print(yaml.safe_dump(resolved.config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    flat = resolved.flat()
    width = max(len(k) for k in flat)
    for key, value in flat.items():
        where = describe_source(resolved, key, flag_for(args, key))
        if where == "config file" and getattr(args, "config_file", None):
            where = f"config file {args.config_file}"
        print(f"{key:<{width}} = {json.dumps(value)}  # {where}")
    return 0


def schema_command(args: argparse.Namespace) -> int:
    from torchbay.registry.resolve import config_model

    print(json.dumps(config_model().model_json_schema(), indent=2))
    return 0


def validate_command(args: argparse.Namespace) -> int:
    from torchbay.launch.plan import prepare
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    resolved = resolve_config(file=args.file, environ={}, pm=pm)  # the file alone, not this shell's env
    plan, context, _ = prepare(resolved, pm)
    print(f"{args.file}: valid. device {context.device_backend_cls.name}, strategy {context.strategy_cls.name}, "
          f"mixed_precision {resolved.config.mixed_precision}, {plan.summary()}")
    return 0


# --- import-accelerate -------------------------------------------------------------------


def _refuse_overwrite(path: str, force: bool) -> None:
    """Refuse, before anything is written, an output that exists (without --force), is a
    directory, or lies in a folder that does not exist."""
    from torchbay.errors import ConfigError

    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"-o '{path}' is a directory; give a file name, e.g. -o {target / DEFAULT_OUTPUT}",
                          header="not writing")
    if not target.absolute().parent.is_dir():
        raise ConfigError(f"-o '{path}': the folder {target.absolute().parent} does not exist; create it or write "
                          f"elsewhere", header="not writing")
    if target.exists() and not force:
        raise ConfigError(f"'{path}' exists; pass --force to overwrite it or -o to write elsewhere",
                          header="not overwriting")


def import_command(args: argparse.Namespace) -> int:
    from torchbay.compat.config_import import import_file, to_yaml

    tree, report = import_file(args.file)
    text = to_yaml(tree, report, args.file)
    if args.output:
        _refuse_overwrite(args.output, args.force)
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    for line in report.lines():
        print(line, file=sys.stderr)
    missing = len(report.not_imported)
    print(f"{len(report.mapped)} mapped, {len(report.ignored)} without effect, {missing} not imported"
          + (f", {len(report.problems)} invalid" if report.problems else ""), file=sys.stderr)
    return 1 if (args.strict and missing) or report.problems else 0


# --- the questionnaire ---------------------------------------------------------------------


class Asker:
    """Asks on stdin; every question has a default (Enter keeps it)."""

    def __init__(self, read: Callable[[str], str] | None = None, out=None):
        self._read, self.out = read, out or sys.stdout

    def read(self, prompt: str) -> str:
        return (self._read or input)(prompt)

    def ask(self, question: str, default: Any, choices: list[str] | None = None, cast: Callable = str) -> Any:
        from torchbay.errors import ConfigError

        hint = f" [{'/'.join(choices)}]" if choices else ""
        while True:
            try:
                answer = self.read(f"{question}{hint} (default: {default}): ").strip()
            except EOFError:
                raise ConfigError("no answer on stdin; answer the questions in a terminal or use "
                                  "torchbay config --default", header="questionnaire stopped") from None
            if not answer:
                return default
            if choices and answer not in choices:
                print(f"  please answer one of: {', '.join(choices)}", file=self.out)
                continue
            try:
                return cast(answer)
            except (TypeError, ValueError):
                print(f"  not a valid {getattr(cast, '__name__', 'value')}: {answer!r}", file=self.out)


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("y", "yes", "true", "1", "on"):
        return True
    if lowered in ("n", "no", "false", "0", "off"):
        return False
    raise ValueError(text)


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "") else int(text)


def _simple_fields(model) -> list[tuple[str, Any, Any, list[str] | None, Callable]]:
    """``(name, field, default, choices, cast)`` for the fields a question can set."""
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        default = field.get_default(call_default_factory=True)
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Union and type(None) in args:
            inner = [a for a in args if a is not type(None)]
            annotation = inner[0] if len(inner) == 1 else annotation
            origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if annotation is bool:
            out.append((name, field, default, ["yes", "no"], _bool))
        elif origin is typing.Literal:
            choices = [str(a) for a in args]
            kinds = {type(a) for a in args}
            cast = int if kinds == {int} else str
            out.append((name, field, default, choices, cast))
        elif annotation in (int, float, str):
            out.append((name, field, default, None, annotation))
    return out


def _ask_section(asker: Asker, pm, section: str, tree: dict[str, Any]) -> None:
    sections = pm.config_sections()
    model = sections.get(section)
    if model is None:
        return
    print(f"-- settings of '{section}' (from its plugin) --", file=asker.out)
    answers = {}
    for name, field, default, choices, cast in _simple_fields(model):
        question = f"{section}.{name}" + (f" - {field.description}" if field.description else "")
        shown = ("yes" if default else "no") if cast is _bool else default
        answer = asker.ask(question, shown, choices, cast)
        if cast is _bool and isinstance(answer, str):
            answer = _bool(answer)
        if cast is int and isinstance(answer, str):
            answer = int(answer)
        if answer != default:
            answers[name] = answer
    if answers:
        tree[section] = answers


def build_interactively(pm, asker: Asker) -> dict[str, Any]:
    registries = pm.registries()
    devices = registries["devices"]
    available = sorted(name for name, cls in devices.items() if cls.is_available())
    tree: dict[str, Any] = {}
    # a question only when there is a choice: one usable device is simply used
    device = asker.ask("Which device?", "auto", ["auto", *available]) if len(available) > 1 else (
        available[0] if available else "auto")
    tree["device"] = device
    device_cls = devices.get(device) if device != "auto" else max(
        (devices[n] for n in available), key=lambda c: c.priority, default=None)

    machines = asker.ask("How many machines?", 1, cast=int)
    launch: dict[str, Any] = {}
    if machines > 1:
        launch["num_machines"] = machines
        launch["machine_rank"] = asker.ask(f"Rank of this machine (0..{machines - 1})?", 0, cast=int)
        launch["main_process_ip"] = asker.ask("Address of machine 0?", "127.0.0.1")
        launch["main_process_port"] = asker.ask("Port on machine 0?", 29500, cast=int)
    on_accelerator = device_cls is not None and device_cls.torch_type() != "cpu"
    default_nproc = max(int(device_cls.device_count()), 1) if on_accelerator else 1
    nproc = asker.ask("How many processes on each machine?", default_nproc, cast=int)
    launch["nproc_per_node"] = nproc
    tree["launch"] = launch
    world = nproc * machines

    strategies = registries["strategies"]
    usable = sorted(n for n, cls in strategies.items() if (cls.multi_process if world > 1 else cls.single_process))
    strategy = asker.ask("Which strategy?", "auto", ["auto", *usable]) if len(usable) > 1 else "auto"
    tree["strategy"] = strategy
    if strategy != "auto":
        _ask_section(asker, pm, strategy, tree)

    _ask_precision(asker, pm, registries["precisions"], device_cls, tree)
    steps = asker.ask("Gradient accumulation steps?", 1, cast=int)
    if steps != 1:
        tree["gradient_accumulation_steps"] = steps
    seed = asker.ask("Seed (none for no seeding)?", "none", cast=_optional_int)
    if seed not in (None, "none"):
        tree["seed"] = seed
    _ask_trackers(asker, pm, registries["trackers"], tree)
    return tree


def _ask_trackers(asker: Asker, pm, registry: dict[str, Any], tree: dict[str, Any]) -> None:
    """Which installed trackers to log to (only those that can run here are offered), then the
    settings of each chosen tracker's own section."""
    installed = sorted(name for name, cls in registry.items() if not cls.unavailable_reason())

    def names(text: str) -> list[str]:
        chosen = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
        unknown = [n for n in chosen if n not in installed and n != "all"]
        if unknown:
            raise ValueError(", ".join(unknown))
        return chosen

    names.__name__ = f"comma-separated list of {', '.join(['all', *installed])} or none"
    chosen = asker.ask(f"Log metrics to which trackers (comma-separated; installed: {', '.join(installed)})?",
                       "none", cast=names)
    if chosen in ("none", []):
        return
    tree["tracking"] = {"log_with": chosen}
    for name in (installed if "all" in chosen else chosen):
        _ask_section(asker, pm, name, tree)


def _ask_precision(asker: Asker, pm, registry: dict[str, Any], device_cls, tree: dict[str, Any]) -> None:
    """Ask for ``mixed_precision`` and, for a mode several engines serve, which engine (written
    as ``<mode>.backend``); autocast modes the device does not support are not offered."""
    from torchbay.axes.precision import by_mode

    modes = by_mode(registry)
    offered = []
    for mode, engines in modes.items():
        dtype = getattr(engines.get(None), "dtype", None)  # an autocast mode: the device must support it
        if device_cls is None or dtype is None or device_cls.supports_autocast(dtype):
            offered.append(mode)
    mode = asker.ask("Mixed precision?", "no", offered) if len(offered) > 1 else "no"
    tree["mixed_precision"] = mode
    engines = sorted(e for e in modes.get(mode, {}) if e is not None)
    if engines:
        backend = asker.ask(f"Which {mode.upper()} engine?", "auto", ["auto", *engines]) if len(engines) > 1 \
            else engines[0]
        tree[mode] = {"backend": backend}
        if backend != "auto":
            _ask_section(asker, pm, backend, tree)


def default_tree(pm) -> dict[str, Any]:
    """A sensible config for this machine: its best device, one process per device."""
    from torchbay.registry.selection import select_device

    problems: list[str] = []
    device_cls = select_device("auto", pm.registries()["devices"], pm, problems)
    tree: dict[str, Any] = {"device": device_cls.name if device_cls else "auto", "strategy": "auto"}
    if device_cls is not None and device_cls.torch_type() != "cpu":
        import torch

        tree["mixed_precision"] = "bf16" if device_cls.supports_autocast(torch.bfloat16) else "no"
        tree["launch"] = {"nproc_per_node": max(int(device_cls.device_count()), 1)}
    else:
        tree["mixed_precision"] = "no"
    return tree


def questionnaire_command(args: argparse.Namespace, asker: Asker | None = None) -> int:
    import yaml

    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    _refuse_overwrite(args.output, args.force)
    tree = default_tree(pm) if args.default else build_interactively(pm, asker or Asker())
    text = "# written by torchbay config\n" + yaml.safe_dump(tree, sort_keys=False)
    path = Path(args.output)
    path.write_text(text)
    try:
        resolve_config(file=path, environ={}, pm=pm)
    except Exception:
        path.unlink()
        raise
    if str(path) == DEFAULT_OUTPUT:
        print(f"wrote {path}; torchbay launch run from this folder reads it (elsewhere: --config-file "
              f"{path.absolute()})", file=sys.stderr)
    else:
        print(f"wrote {path}; use it with: torchbay launch --config-file {path} script.py "
              f"(or export TORCHBAY_CONFIG_FILE={path})", file=sys.stderr)
    return 0
