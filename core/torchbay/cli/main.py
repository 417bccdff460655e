"""``torchbay``: entry point. Each subcommand lives in its own module with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys

from torchbay.errors import TorchbayError

#: subcommand modules under torchbay.cli, each with ``register(subparsers)``
COMMAND_MODULES = ("launch", "config_cmd", "env", "plugins_cmd", "test_cmd", "estimate_memory", "new_plugin")


def build_parser() -> argparse.ArgumentParser:
    from torchbay.plugins import get_plugin_manager

    parser = argparse.ArgumentParser(prog="torchbay", description="Run your own PyTorch loop on any device, "
                                     "strategy and precision.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"torchbay.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"torchbay.cli.{name}":
                continue  # command not built yet
            raise
        module.register(subparsers)
    get_plugin_manager().hook.torchbay_add_commands.call_historic(kwargs={"subparsers": subparsers})
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TorchbayError as exc:
        print(f"torchbay {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
