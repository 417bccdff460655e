"""Resolving the configuration tree from its sources (defaults < file < environment < flags < arguments) for the
plugins installed: the config class with every plugin's section, did-you-mean errors, precision modes no plugin
provides. The tree itself is :mod:`torchbay.config.model`."""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError, create_model

from torchbay.axes.precision import by_mode, mode_install_hint
from torchbay.config.files import CONFIG_FILE_ENV, load_yaml_file
from torchbay.config.model import (
    RENAMED_KEYS,
    RESOLVED_ENV,
    CoreConfig,
    LazySection,
    ResolvedConfig,
    dotted_to_tree,
    env_values,
    merge,
    section_field,
)
from torchbay.errors import ConfigError
from torchbay.registry.manager import get_plugin_manager
from torchbay.registry.published import SECTION, install_hint

_models: dict[tuple, type[CoreConfig]] = {}


def config_model(pm=None) -> type[CoreConfig]:
    """The config class for the plugins loaded in ``pm`` (core sections plus theirs)."""
    if pm is None:
        pm = get_plugin_manager()
    sections = pm.config_sections()
    key = tuple(sorted((name, id(model)) for name, model in sections.items()))
    if key not in _models:
        clashes = set(sections) & set(CoreConfig.model_fields)
        if clashes:
            raise ConfigError([f"a plugin's config section '{n}' clashes with a core key" for n in sorted(clashes)])
        fields = {name: (LazySection[model], section_field(model)) for name, model in sections.items()}
        _models[key] = create_model("TorchbayConfig", __base__=CoreConfig, **fields)
    return _models[key]


def resolve_config(*, file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
                   cli: Mapping[str, Any] | None = None, args: Mapping[str, Any] | None = None,
                   pm=None, use_launcher_config: bool = True,
                   sourced: Mapping[str, tuple[Any, str]] | None = None) -> ResolvedConfig:
    """Build and validate the tree from every source; raise :class:`ConfigError` listing all problems.

    ``cli`` and ``args`` may use dotted keys (``{"mysection.some_key": 2}``) or nested dicts.
    In a worker started by ``torchbay launch``, the launcher's resolved tree is the base
    and only ``args`` are layered on top. ``sourced`` (``{dotted key: (value, source label)}``, e.g. what
    Accelerate's kwargs handlers say) is layered just below ``args``, each value recorded with its own label.
    """
    environ = os.environ if environ is None else environ
    if pm is None:
        pm = get_plugin_manager()
    model = config_model(pm)
    sources: dict[str, str] = {}
    tree: dict[str, Any] = {}
    launched = environ.get(RESOLVED_ENV) if use_launcher_config else None
    if launched:
        try:
            payload = json.loads(launched)
            tree, sources = payload["config"], dict(payload["sources"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{RESOLVED_ENV} is not a config written by torchbay launch ({exc}); unset it") from None
    else:
        file = file or environ.get(CONFIG_FILE_ENV) or None
        layers = [("file", load_yaml_file(file) if file else {}),
                  ("env", env_values(environ)),
                  ("cli", dotted_to_tree(cli or {}))]
        for source, layer in layers:
            merge(tree, layer, source, sources)
    for dotted, (value, label) in (sourced or {}).items():
        merge(tree, dotted_to_tree({dotted: value}), label, sources)
    merge(tree, dotted_to_tree(args or {}), "args", sources)
    problems = mode_problems(tree.get("mixed_precision", "no"), pm, sources)
    if not tree and not problems:
        # no source set a value: the tree is its defaults, which need no validator (building the tree's is
        # ~10 ms of a run's start-up, pydantic's scan of entry points for its own plugins included)
        return ResolvedConfig(model.model_construct(), sources)
    try:
        config = model.model_validate(tree)
    except ValidationError as exc:
        problems = describe_errors(exc, model, sources) + problems
    if problems:
        raise ConfigError(problems)
    return ResolvedConfig(config, sources)


def mode_problems(mode: Any, pm, sources: dict[str, str]) -> list[str]:
    """``mixed_precision`` names a mode no installed plugin registers: say what to install."""
    modes = by_mode(pm.registries()["precisions"])
    if not isinstance(mode, str) or mode in modes:
        return []  # a value of the wrong type is reported by the model
    source = _source_for("mixed_precision", sources)
    where = f" (set in {source})" if source else ""
    return [f"'mixed_precision' = {mode!r}{where}: no installed plugin registers this precision mode "
            f"(registered: {', '.join(modes)}); use one of them, or install {mode_install_hint(mode)}"]


def describe_errors(exc: ValidationError, model: type[BaseModel], sources: dict[str, str]) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        dotted = ".".join(loc)
        source = _source_for(dotted, sources)
        where = f" (set in {source})" if source else ""
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown key '{dotted}'{where}; {_suggest(model, loc)}")
        else:
            problems.append(f"'{dotted}' = {err.get('input')!r}{where}: {err['msg']}")
    return problems


_SOURCE_LABELS = {"env": "the environment (TORCHBAY_*)", "file": "the config file",
                  "cli": "a command-line flag", "args": "Accelerator(...) arguments"}


def _source_for(dotted: str, sources: dict[str, str]) -> str:
    probe = dotted
    while probe:
        if probe in sources:
            return _SOURCE_LABELS.get(sources[probe], sources[probe])
        probe = probe.rpartition(".")[0]
    for key, source in sources.items():
        if key.startswith(dotted + "."):
            return _SOURCE_LABELS.get(source, source)
    return ""


def _suggest(model: type[BaseModel], loc: list[str]) -> str:
    key = loc[-1]
    parent: Any = model
    for part in loc[:-1]:
        field = parent.model_fields.get(part) if isinstance(parent, type) and issubclass(parent, BaseModel) else None
        parent = field.annotation if field is not None else None
    valid = sorted(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
    if len(loc) == 1 and key in RENAMED_KEYS:
        return f"it now lives at '{RENAMED_KEYS[key]}'"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{'.'.join(loc[:-1] + close)}'?"
    if len(loc) == 1:
        return f"no installed plugin provides a section '{key}' ({install_hint(SECTION, key, valid)}); " \
               f"valid keys: {', '.join(valid)}"
    return f"valid keys here: {', '.join(valid)}"
