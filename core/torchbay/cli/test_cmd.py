"""``torchbay test``: a short real training on the configured set-up, with pass/fail per check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SELFTEST = str(Path(__file__).resolve().parent / "_selftest.py")


def register(subparsers) -> None:
    from torchbay.cli.options import add_config_options

    parser = subparsers.add_parser(
        "test", help="run a short real training in every process and report each check",
        usage="torchbay test [options]",
        description="Start the configured job (same flags as torchbay launch) running a tiny model: checks the "
                    "process group, collectives, data sharding, one optimizer step and a save/load round trip.")
    add_config_options(parser, "test")
    parser.add_argument("-q", "--quiet", action="store_true", help="do not print the plan line")
    parser.set_defaults(func=test_command)


def test_command(args: argparse.Namespace) -> int:
    import os

    from torchbay.cli.launch import _exit_now, _is_console_command
    from torchbay.cli.options import cli_values
    from torchbay.config.model import RESOLVED_ENV
    from torchbay.launch.plan import prepare
    from torchbay.launch.run import exec_direct, run_torchrun
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    cli = cli_values(args)
    cli.setdefault("process_group_timeout_s", 120)  # a broken set-up fails the test instead of hanging it
    environ = {k: v for k, v in os.environ.items() if k != RESOLVED_ENV}
    resolved = resolve_config(file=args.config_file, environ=environ, cli=cli, pm=pm)
    plan, context, env = prepare(resolved, pm)
    if not args.quiet:
        print(f"torchbay test: {plan.summary()}", file=sys.stderr, flush=True)
    if plan.mode == "direct":
        exec_direct(plan, env, SELFTEST, [])
    code = run_torchrun(plan, env, SELFTEST, [])
    if _is_console_command():
        _exit_now(code)
    return code
