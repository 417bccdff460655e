"""``accelerate.commands.config`` and ``accelerate.commands.launch`` as the libraries call them (trl's CLI,
transformers' ``env``): Accelerate's config file is read as it is, and a launch is ``torchbay launch --as-accelerate``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

#: where Accelerate keeps its default config (``accelerate config`` writes it; libraries read it)
default_config_file = os.path.join(
    os.path.expanduser(os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"),
                                                              "huggingface"))),
    "accelerate", "default_config.yaml")


class AccelerateConfigFile:
    """An Accelerate config file's settings (``load_config_from_file(path).to_dict()``)."""

    def __init__(self, settings: dict[str, Any], path: str):
        self._settings = settings
        self.path = path

    def to_dict(self) -> dict[str, Any]:
        return dict(self._settings)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._settings[name]
        except KeyError:
            raise AttributeError(f"{self.path} has no setting {name!r}") from None


def load_config_from_file(config_file: str | None = None) -> AccelerateConfigFile:
    """Read an Accelerate YAML or JSON config file (the default one when ``config_file`` is None)."""
    import json

    from torchbay.config_files import load_yaml_file
    from torchbay.errors import ConfigError

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

        from torchbay.cli.main import build_parser

        argv = ["launch", "--as-accelerate", *(sys.argv[1:] if args is None else args)]
        parsed = build_parser().parse_args(argv)
        parsed._argv = argv
        return parsed


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's ``accelerate launch`` parser; ``launch_command`` runs what it parsed through torchbay."""
    return _LaunchParser(prog="accelerate launch (torchbay launch --as-accelerate)", add_help=False)


def launch_command(args: argparse.Namespace) -> None:
    """Run a parsed launch; a failed job ends this process with the job's exit code, as Accelerate's does."""
    code = args.func(args)
    if code:
        raise SystemExit(code)
