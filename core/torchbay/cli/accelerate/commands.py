"""``accelerate.commands.config`` and ``accelerate.commands.launch`` as the libraries call them (trl's CLI,
transformers' ``env``): Accelerate's config file is read as it is, and a launch is ``torchbay launch --as-accelerate``.
"""

from __future__ import annotations

import argparse
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


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's ``accelerate launch`` parser: Accelerate's namespace (``multi_gpu``, ``use_fsdp``,
    ``num_processes``, ``training_script``...), made from torchbay launch's flags and the Accelerate tables
    (launch_namespace.py); ``launch_command`` runs what it parsed through torchbay."""
    from torchbay.cli.accelerate.launch_namespace import build_launch_parser

    return build_launch_parser()


def _validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, bool]:
    """``(args, the config file's settings or None, whether mixed_precision came from it)``: ``args`` completed from
    the Accelerate config file the launch reads, as Accelerate completes it (launch_validation.py)."""
    from torchbay.cli.accelerate.launch_validation import validate_launch_command

    return validate_launch_command(args)


def launch_command(args: argparse.Namespace) -> None:
    """Run a parsed launch with ``torchbay launch --as-accelerate``: the flags the namespace was given (or changed
    to), with the config file Accelerate would read; a failed job ends this process with the job's exit code, as
    Accelerate's does."""
    from torchbay.cli.accelerate.launch_namespace import launch_tokens
    from torchbay.cli.accelerate.launch_validation import accelerate_config_in_use

    tokens = launch_tokens(launch_command_parser(), args)  # before the config file fills the namespace
    _validate_launch_command(args)  # Accelerate's checks: an unknown config key, switches that conflict
    config = None if getattr(args, "config_file", None) else accelerate_config_in_use(args)
    if config:  # Accelerate's default config file, which the launch reads as Accelerate does
        tokens = ["--config_file", config, *tokens]
    parser = build_parser()
    given, imported = with_torchbay_config(tokens)
    try:
        argv = with_accelerate_spellings(parser, ["launch", "--as-accelerate", *given])  # --num_processes...
        parsed = parser.parse_args(argv)
        parsed._argv = argv
        parsed._imported_config = imported
        code = parsed.func(parsed)
    finally:
        remove_imported_config(imported)
    if code:
        raise SystemExit(code)
