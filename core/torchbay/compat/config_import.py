"""Convert a Hugging Face Accelerate config file into a torchbay config.

The mapping is data: Accelerate's key names and values on one side, torchbay's dotted keys on
the other. The core's table (``torchbay/resources/accelerate.yaml``) covers cpu, single, ddp
and the generic keys; each plugin adds what it serves (a device's ``distributed_type``, a
strategy's nested config...) from an ``accelerate.yaml`` in its own package, which the plugin manager reads
(:mod:`torchbay.registry.fragments`). An Accelerate value or key that no
installed plugin maps is reported as not imported, saying which kind of plugin would map it.
Every key of the input ends up in exactly one of three lists, so that nothing is dropped
silently:

- ``mapped``: written to the torchbay config;
- ``ignored``: has no effect at its value (``tpu_use_sudo: false``);
- ``not_imported``: would change behaviour but has no torchbay equivalent, with the reason.

Keys going into a plugin's section (e.g. Accelerate's nested configs of plugin strategies)
are checked against that plugin's section model when the plugin is installed; otherwise
they are written and listed as unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from torchbay.config.files import load_yaml_file, read_packaged_yaml
from torchbay.config.model import dotted_to_tree
from torchbay.errors import ConfigError
from torchbay.process.state import distributed_type_names
from torchbay.registry.fragments import read_fragment  # noqa: F401 (its old path, still served)
from torchbay.registry.manager import get_plugin_manager
from torchbay.registry.resolve import config_model, describe_errors

#: the reason given for an Accelerate value or nested config that no installed plugin maps
NO_PLUGIN = ("no installed plugin maps it; install the torchbay {kind} for it "
             "(`torchbay plugins` lists what is installed)")
#: the reason given for a top-level key that neither the core nor an installed plugin maps
UNKNOWN_KEY = ("neither torchbay nor an installed plugin maps this key (if a torchbay plugin serves it, install that "
               "plugin: `torchbay plugins` lists what is installed)")


def core_table() -> dict[str, Any]:
    """The core's own import table (``torchbay/resources/accelerate.yaml``), without the plugins' parts."""
    return read_packaged_yaml("torchbay", "resources/accelerate.yaml")


def mapping_table(pm=None) -> dict[str, Any]:
    """The import table: the core's, with every installed plugin's ``config_import`` fragment merged in."""
    if pm is None:

        pm = get_plugin_manager()
    return pm.accelerate_mapping("config_import", core_table())


@dataclass
class ImportReport:
    mapped: list[tuple[str, Any, str, Any]] = field(default_factory=list)  # (key, its value, torchbay key, value)
    ignored: list[tuple[str, Any, str]] = field(default_factory=list)  # (key, value, why)
    not_imported: list[tuple[str, Any, str]] = field(default_factory=list)  # (key, value, why)
    unchecked: list[str] = field(default_factory=list)  # notes on sections no installed plugin checks
    notes: list[str] = field(default_factory=list)  # imported, but meaning something else than in Accelerate
    problems: list[str] = field(default_factory=list)  # the result does not validate here

    def lines(self) -> list[str]:
        out = []
        for key, original, target, value in self.mapped:
            out.append(f"mapped       {key} = {original!r} -> {target} = {value!r}")
        for key, value, why in self.ignored:
            out.append(f"ignored      {key} = {value!r} (no effect{': ' + why if why else ''})")
        for key, value, why in self.not_imported:
            out.append(f"NOT IMPORTED {key} = {value!r}: {why}")
        for note in self.notes:
            out.append(f"NOTE         {note}")
        for note in self.unchecked:
            out.append(f"unchecked    {note}")
        for problem in self.problems:
            out.append(f"invalid      {problem}")
        return out


def flag_of(spec: dict[str, Any], key: str) -> str:
    """The ``accelerate launch`` flag (without ``--``) for ``key`` of the nested config ``spec``: the key, with the
    section's ``flag_prefix`` when it lacks it (fp8_config's ``margin`` is ``--fp8_margin``)."""
    prefix = spec.get("flag_prefix") or ""
    return key if key.startswith(prefix) else prefix + key


def _norm_enum(value: Any, what: str) -> Any:
    # YAML 1.1 reads an unquoted NO / no as false
    if value is False and what in ("distributed_type", "mixed_precision", "dynamo_backend", "downcast_bf16"):
        return "NO" if what != "mixed_precision" else "no"
    return value


def _lookup(table: dict, value: Any) -> tuple[bool, Any]:
    for candidate in (value, str(value), str(value).upper()):
        if candidate in table and not (isinstance(candidate, bool) != isinstance(value, bool)):
            return True, table[candidate]
    return False, None


def convert(data: dict[str, Any], pm=None) -> tuple[dict[str, Any], ImportReport]:
    """``(torchbay config tree, report)`` for a loaded Accelerate config mapping."""
    if pm is None:

        pm = get_plugin_manager()
    table = mapping_table(pm)
    report = ImportReport()
    flat: dict[str, Any] = {}
    data = dict(data)

    def put(acc_key: str, dotted: str, value: Any, original: Any = None) -> None:
        flat[dotted] = value
        report.mapped.append((acc_key, value if original is None else original, dotted, value))

    compute = data.pop("compute_environment", None)
    if compute is not None:
        if compute in table["compute_environment"]:
            report.ignored.append(("compute_environment", compute, "torchbay launch runs on this machine"))
        else:
            why = table["unsupported_compute_environment"].get(compute, "unknown compute environment")
            report.not_imported.append(("compute_environment", compute, why))

    dist_type = _norm_enum(data.pop("distributed_type", "NO"), "distributed_type")
    use_cpu = data.get("use_cpu")
    if dist_type in table["distributed_type"]:
        for key, value in table["distributed_type"][dist_type].items():
            put("distributed_type", key, value, dist_type)
        if not table["distributed_type"][dist_type]:
            report.ignored.append(("distributed_type", dist_type,
                                   "torchbay picks single or ddp from the process count"))
    else:
        why = table["unsupported_distributed_type"].get(str(dist_type))
        if why is None and str(dist_type) in distributed_type_names():  # Accelerate's, for a plugin to map
            why = NO_PLUGIN.format(kind="device plugin" if str(dist_type).startswith("MULTI_")
                                   else "strategy or device plugin")
        report.not_imported.append(("distributed_type", dist_type, why or f"unknown distributed_type {dist_type!r}"))
    if use_cpu:
        data.pop("use_cpu")
        put("use_cpu", "device", "cpu", use_cpu)

    for acc_key, dotted in table["top_level"].items():
        if acc_key in data:
            value = _norm_enum(data.pop(acc_key), acc_key)
            if value is None:
                report.ignored.append((acc_key, value, "unset"))
            else:
                put(acc_key, dotted, value)

    section_for_type = table["section_of_distributed_type"]
    sections = table["sections"]
    for acc_section in [key for key in data if key in sections]:  # in the file's order, whatever the plugins'
        spec = sections[acc_section]
        if "target" not in spec:  # only other plugins' additions: the plugin owning the section is not installed
            continue
        body = data.pop(acc_section)
        if not body:
            report.ignored.append((acc_section, body, "empty"))
            continue
        if not isinstance(body, dict):
            report.not_imported.append((acc_section, body, "expected a mapping"))
            continue
        owner = [t for t, s in section_for_type.items() if s == acc_section]
        if owner and dist_type not in owner:
            for key, value in body.items():
                report.ignored.append((f"{acc_section}.{key}", value,
                                       f"distributed_type is {dist_type}, not {owner[0]}, "
                                       "so Accelerate ignores it too"))
            continue
        _convert_section(acc_section, spec, body, put, report, flat)

    for key in list(data):
        value = data.pop(key)
        rule = table["no_effect"].get(key)
        if rule is not None and (rule.get("any") or value in rule.get("values", [])):
            report.ignored.append((key, value, rule.get("reason", "")))
        elif key in table["not_imported"]:
            report.not_imported.append((key, value, table["not_imported"][key]))
        elif value is None or value == {}:
            report.ignored.append((key, value, "empty"))  # e.g. the nested config of a plugin not installed
        elif isinstance(value, dict):  # a nested config no installed plugin maps: each of its keys
            for sub, sub_value in value.items():
                report.not_imported.append((f"{key}.{sub}", sub_value, f"{key}: " + NO_PLUGIN.format(kind="plugin")))
        else:
            report.not_imported.append((key, value, UNKNOWN_KEY))

    tree = dotted_to_tree(flat)
    _check(tree, table, report, pm, config_model)
    return tree, report


def _convert_section(acc_section: str, spec: dict, body: dict, put, report: ImportReport, flat: dict) -> None:
    target = spec["target"]
    for key, value in body.items():
        name = f"{acc_section}.{key}"
        rule = spec.get("keys", {}).get(key)
        original = value
        if rule is None:
            report.not_imported.append((name, value, f"no torchbay '{target}' setting corresponds to it"))
            continue
        if "ignore" in rule and value in rule["ignore"]:
            report.ignored.append((name, value, rule.get("reason", "")))
            continue
        if "key" not in rule and "top" not in rule:
            report.not_imported.append((name, value, rule.get("reason", "no torchbay equivalent")))
            continue
        if "unmapped" in rule:
            found, why = _lookup(rule["unmapped"], value)
            if found:
                report.not_imported.append((name, value, why))
                continue
        if "values" in rule:
            found, translated = _lookup(rule["values"], value)
            if not found:
                why = f"value not understood (known: {', '.join(map(str, rule['values'])) or 'none installed'})"
                if rule.get("values_from"):  # plugins add the values: one not installed may map this one
                    why += (f"; another value needs its {rule['values_from']}: "
                            "`torchbay plugins` lists what is installed")
                report.not_imported.append((name, value, why))
                continue
            value = translated
        if "split" in rule and isinstance(value, str):
            value = [part.strip() for part in value.split(rule["split"]) if part.strip()]
        put(name, rule["top"] if "top" in rule else f"{target}.{rule['key']}", value, original)
    for key, note in (spec.get("absent") or {}).items():
        if key not in body:
            report.notes.append(f"{acc_section}.{key} is absent: {' '.join(note.split())}")
    for key, implied in (spec.get("implies") or {}).items():
        current = flat.get(f"{target}.{key}")
        for sub, value in (implied.get(current) or {}).items():
            if f"{target}.{sub}" not in flat:
                put(f"{acc_section}.{key}", f"{target}.{sub}", value, body.get(key))


def convert_section(acc_section: str, spec: dict, body: dict, report: ImportReport) -> dict[str, Any]:
    """``{torchbay dotted key: value}`` for the keys ``body`` of Accelerate's nested config ``acc_section`` (its
    table entry ``spec``), each also listed in ``report``: what ``accelerate launch``'s flag of the same name sets."""
    flat: dict[str, Any] = {}

    def put(acc_key: str, dotted: str, value: Any, original: Any = None) -> None:
        flat[dotted] = value
        report.mapped.append((acc_key, value if original is None else original, dotted, value))

    _convert_section(acc_section, spec, body, put, report, flat)
    return flat


def handler_settings(handler: Any, pm=None) -> dict[str, tuple[Any, str]]:
    """What an Accelerate kwargs handler of a plugin says, as ``{dotted key: (value, source label)}``.

    The handler names Accelerate's nested config it stands for (``accelerate_section``, e.g. ``fp8_config``) and
    gives its keys as ``accelerate_keys()`` (``{key: (value, keyword or None)}``); they are read with the same
    table as those keys of a config file, so a handler and the equivalent YAML set the same settings. Each
    value's label names the handler and its keyword; a key nothing maps is a ConfigError naming the keyword.
    ``torchbay_config()``, when the handler has one, adds settings of its own (already labelled).
    """
    name = type(handler).__name__
    keys = handler.accelerate_keys()
    spec = mapping_table(pm)["sections"].get(handler.accelerate_section) or {}

    def label(key: str) -> str:
        value, keyword = keys.get(key, (None, None))
        return f"kwargs handler {name}({keyword}={value!r})" if keyword else f"kwargs handler {name}"

    report = ImportReport()
    flat = convert_section(handler.accelerate_section, spec, {k: v for k, (v, _) in keys.items()}, report)
    problems = [f"{label(acc.partition('.')[2])}: {why}" for acc, _, why in report.not_imported]
    if problems:
        raise ConfigError(problems)
    origin = {dotted: acc.partition(".")[2] for acc, _, dotted, _ in report.mapped}
    out = {dotted: (value, label(origin.get(dotted, ""))) for dotted, value in flat.items()}
    out.update(handler.torchbay_config() if hasattr(handler, "torchbay_config") else {})
    return out


def _check(tree: dict, table: dict, report: ImportReport, pm, config_model) -> None:
    """Validate against the installed sections; name what cannot be checked here."""
    from pydantic import ValidationError

    model = config_model(pm)
    checkable = dict(tree)
    for spec in table["sections"].values():
        target = spec.get("target")
        if target in checkable and target not in model.model_fields:
            checkable.pop(target)
            report.unchecked.append(f"section '{target}' is written as imported, but no installed plugin "
                                    f"provides it, so it is not checked: pip install {spec.get('plugin', target)}")
    try:
        model.model_validate(checkable)
    except ValidationError as exc:

        report.problems.extend(describe_errors(exc, model, {}))


def import_file(path: str, pm=None) -> tuple[dict[str, Any], ImportReport]:
    data = load_yaml_file(path, equal_repeats=True)  # as Accelerate's files are read (accelerate_config_file)
    if "distributed_type" not in data and "compute_environment" not in data:
        raise ConfigError(f"'{path}' does not look like an Accelerate config (no distributed_type or "
                          f"compute_environment key)")
    return convert(data, pm)


def to_yaml(tree: dict[str, Any], report: ImportReport, source: str) -> str:
    header = [f"# torchbay config imported from the Accelerate config {source}"]
    for key, value, why in report.not_imported:
        header.append(f"# NOT IMPORTED {key}: {value!r} ({why})")
    for note in report.notes:
        header.append(f"# NOTE {note}")
    for note in report.unchecked:
        header.append(f"# unchecked: {note}")
    body = yaml.safe_dump(tree, sort_keys=False) if tree else "{}\n"
    return "\n".join(header) + "\n" + body
