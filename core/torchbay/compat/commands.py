"""``accelerate.commands.config`` and ``accelerate.commands.launch`` as the libraries call them (trl's CLI,
transformers' ``env``): Accelerate's config file is read as it is, and a launch is ``torchbay launch --as-accelerate``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from torchbay.cli.main import build_parser, with_accelerate_spellings
from torchbay.compat.config_import import import_file, to_yaml
from torchbay.config.files import load_yaml_file
from torchbay.errors import ConfigError

#: where Accelerate keeps its default config (``accelerate config`` writes it; libraries read it)
default_config_file = os.path.join(
    os.path.expanduser(os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"),
                                                              "huggingface"))),
    "accelerate", "default_config.yaml")


class AccelerateConfigFile:
    """An Accelerate config file's settings (``load_config_from_file(path).to_dict()``)."""

    def __init__(self, settings: dict[str, Any] | None = None, path: str | None = None, **given: Any):
        self._settings = {**(settings or {}), **given}  # ClusterConfig(compute_environment=..., ...) too
        self.path = path

    def to_dict(self) -> dict[str, Any]:
        return dict(self._settings)

    def to_yaml_file(self, yaml_file: str) -> None:
        """Write the settings as YAML to ``yaml_file``; only a new file, or the file these settings came from."""
        import yaml

        if os.path.exists(yaml_file) and os.path.abspath(yaml_file) != os.path.abspath(self.path or ""):
            raise ConfigError(f"{yaml_file} exists and is not the file these settings were read from: torchbay "
                              "does not write over it; give a new path")
        with open(yaml_file, "w", encoding="utf-8") as handle:
            yaml.safe_dump(self.to_dict(), handle, sort_keys=False)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._settings[name]
        except KeyError:
            raise AttributeError(f"{self.path} has no setting {name!r}") from None


#: Accelerate's config classes (``accelerate.commands.config.config_args``): one settings holder serves them
BaseConfig = ClusterConfig = AccelerateConfigFile


def load_config_from_file(config_file: str | None = None) -> AccelerateConfigFile:
    """Read an Accelerate YAML or JSON config file (the default one when ``config_file`` is None)."""
    import json

    path = config_file or default_config_file
    if not os.path.isfile(path):
        raise ConfigError(f"Accelerate config file {path} does not exist; give an existing file or write one with "
                          "`torchbay config` (torchbay reads Accelerate's files as they are)")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as handle:
            settings = json.load(handle)
    else:
        settings = load_yaml_file(path) or {}
    return AccelerateConfigFile(settings, path)


class _LaunchParser(argparse.ArgumentParser):
    """Parses ``accelerate launch`` arguments as ``torchbay launch --as-accelerate`` arguments."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        import sys

        parser = build_parser()
        given, imported_config = with_torchbay_config(_with_default_config(list(sys.argv[1:] if args is None
                                                                                else args)))
        argv = with_accelerate_spellings(parser, ["launch", "--as-accelerate", *given])  # --num_processes...
        parsed = parser.parse_args(argv)
        parsed._argv = argv
        parsed._imported_config = imported_config
        return parsed


def _with_default_config(args: list[str]) -> list[str]:
    """As ``accelerate launch`` does, Accelerate's default config file is read when no config file is named (and
    neither ``./torchbay.yaml`` nor ``TORCHBAY_CONFIG_FILE`` names one)."""
    from torchbay.cli.options import DEFAULT_CONFIG_FILE
    from torchbay.config.files import CONFIG_FILE_ENV

    before_script = []
    for token in args:
        if not token.startswith("-"):
            break
        before_script.append(token.partition("=")[0])
    named = {"--config_file", "--config-file"} & set(before_script)
    if named or os.environ.get(CONFIG_FILE_ENV) or os.path.isfile(DEFAULT_CONFIG_FILE) or \
            not os.path.isfile(default_config_file):
        return args
    return ["--config_file", default_config_file, *args]


def with_torchbay_config(args: list[str]) -> tuple[list[str], str | None]:
    """Replace an Accelerate ``--config_file`` (before the script) by the torchbay config imported from it.

    The import is what ``torchbay config import-accelerate`` does; its report goes to stderr, and the imported
    config is written to a new temporary file (the user's file is only read), whose path is returned with the
    arguments: ``launch_command`` removes it once the launch has read it.
    """
    import sys
    import tempfile

    for index, token in enumerate(args):
        if not token.startswith("-"):
            break  # the script: what follows is its own
        flag, _, value = token.partition("=")
        if flag not in ("--config_file", "--config-file"):
            continue
        value = value or (args[index + 1] if index + 1 < len(args) else "")
        settings = load_config_from_file(value).to_dict() if value else {}
        if "distributed_type" not in settings and "compute_environment" not in settings:
            return args, None  # already a torchbay config
        tree, report = import_file(value)
        worth_saying = [line for line in report.lines() if not line.startswith(("mapped", "ignored"))]
        print(f"torchbay: the Accelerate config {value} imported as torchbay settings ({len(report.mapped)} mapped, "
              f"{len(report.ignored)} without effect here; `torchbay config import-accelerate` shows each)"
              + "".join(f"\n  {line}" for line in worth_saying), file=sys.stderr)
        handle = tempfile.NamedTemporaryFile("w", prefix="torchbay-from-accelerate-", suffix=".yaml", delete=False)
        with handle:
            handle.write(to_yaml(tree, report, value))
        rest = args[index + 1:] if "=" in token else args[index + 2:]
        return [*args[:index], "--config-file", handle.name, *rest], handle.name
    return args, None


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's ``accelerate launch`` parser; ``launch_command`` runs what it parsed through torchbay."""
    return _LaunchParser(prog="accelerate launch (torchbay launch --as-accelerate)", add_help=False)


def launch_command(args: argparse.Namespace) -> None:
    """Run a parsed launch; a failed job ends this process with the job's exit code, as Accelerate's does."""
    try:
        code = args.func(args)
    finally:
        imported = getattr(args, "_imported_config", None)
        if imported and os.path.isfile(imported):  # the temporary file _with_torchbay_config wrote, nothing else
            os.remove(imported)
    if code:
        raise SystemExit(code)
