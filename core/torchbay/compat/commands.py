"""``accelerate.commands.config`` and ``accelerate.commands.launch`` as the libraries call them (trl's CLI,
transformers' ``env``): Accelerate's config file is read as it is, and a launch is ``torchbay launch --as-accelerate``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from torchbay.cli.main import build_parser, with_accelerate_spellings
from torchbay.compat.accelerate_config_file import (  # noqa: F401 (accelerate.commands.config's names)
    AccelerateConfigFile,
    BaseConfig,
    ClusterConfig,
    SageMakerConfig,
    default_config_file,
    load_config_from_file,
    remove_imported_config,
    with_torchbay_config,
)


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


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's ``accelerate launch`` parser; ``launch_command`` runs what it parsed through torchbay."""
    return _LaunchParser(prog="accelerate launch (torchbay launch --as-accelerate)", add_help=False)


def launch_command(args: argparse.Namespace) -> None:
    """Run a parsed launch; a failed job ends this process with the job's exit code, as Accelerate's does."""
    try:
        code = args.func(args)
    finally:
        remove_imported_config(getattr(args, "_imported_config", None))
    if code:
        raise SystemExit(code)
