"""The ``accelerate`` command under the switch (``accelerate.commands.accelerate_cli:main``, the console script the
real Accelerate installs): each of its subcommands, with Accelerate's spellings, runs torchbay's own.

========================  =====================================================================
``accelerate launch``     ``torchbay launch --as-accelerate`` (an Accelerate ``--config_file`` is imported as
                          ``torchbay config import-accelerate`` does; Accelerate's default config file is read
                          when no config is named, as Accelerate reads it)
``accelerate config``     ``torchbay config`` (the questionnaire) writing ``--config_file`` (default: Accelerate's
                          default config file); ``accelerate config default`` writes Accelerate's basic config
                          (``write_basic_config``)
``accelerate env``        ``torchbay env``
``accelerate test``       ``torchbay test``
``accelerate estimate-memory``, ``merge-weights``: torchbay's commands of the same role
``accelerate to-fsdp2``,  the plugin that declares the command in its accelerate.yaml (``api: commands``;
``tpu-config``...         cli/accelerate/plugin_commands.py): without it, the error names the distribution to install
========================  =====================================================================

A failure says that torchbay answered and how to run the same job with torchbay's own command, or Accelerate's.
"""

from __future__ import annotations

import sys
import traceback

from torchbay.errors import TorchbayError

#: ``accelerate`` subcommand -> the torchbay command that serves it (None: handled here)
COMMANDS = {"launch": None, "config": None, "env": None, "test": None,
            "estimate-memory": ["estimate-memory"], "estimate": ["estimate-memory"],
            "merge-weights": ["merge-weights"]}

POINTER = ("torchbay answered `accelerate` here because TORCHBAY_AS_ACCELERATE=1 is set: the same run is "
           "`torchbay launch --as-accelerate [flags] script.py` (torchbay launch --help lists the flags); unset "
           "TORCHBAY_AS_ACCELERATE to run Accelerate itself")


def main(argv: list[str] | None = None) -> int:
    """``accelerate COMMAND ...`` served by torchbay: the command's exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] not in COMMANDS and argv[0] not in _commands()):
        return _usage(argv)
    command, rest = argv[0], argv[1:]
    try:
        code = _run(command, rest)
    except TorchbayError as exc:
        print(f"accelerate {command} (served by torchbay): error: {exc}\n{POINTER}", file=sys.stderr)
        code = 2
    except SystemExit:
        raise
    except KeyboardInterrupt:
        code = 130
    except Exception:  # a bug or an unexpected failure: the traceback, then what to run instead
        traceback.print_exc()
        print(POINTER, file=sys.stderr)
        code = 1
    return code


def _commands() -> set[str]:
    """The commands served here and those a plugin serves (installed, or published: then it says what to install)."""
    from torchbay.cli.accelerate.plugin_commands import known

    return set(COMMANDS) | set(known())


def _usage(argv: list[str]) -> int:
    known = ", ".join(sorted(_commands()))
    unknown = f"unknown command {argv[0]!r}; " if argv and argv[0] not in ("-h", "--help") else ""
    print(f"usage: accelerate COMMAND [ARGS] (served by torchbay)\n{unknown}commands: {known}", file=sys.stderr)
    return 2 if unknown or not argv else 0


def _run(command: str, rest: list[str]) -> int:
    from torchbay.cli.main import main as torchbay_main

    if command == "launch":
        from torchbay.cli.accelerate.commands import launch_command, launch_command_parser

        launch_command(launch_command_parser().parse_args(rest))
        return 0
    if command == "config":
        from torchbay.cli.accelerate.config_commands import config_main

        return config_main(rest)
    if command in ("env", "test"):
        from torchbay.cli.accelerate import config_commands

        parser = getattr(config_commands, f"{command}_command_parser")()
        getattr(config_commands, f"{command}_command")(parser.parse_args(rest))
        return 0
    if command not in COMMANDS:
        from torchbay.cli.accelerate.plugin_commands import run

        return run(command, rest)  # the plugin's command
    return torchbay_main([*COMMANDS[command], *_dashed_config_file(rest)])


def _dashed_config_file(rest: list[str]) -> list[str]:
    """Accelerate's ``--config_file`` is torchbay's ``--config-file``."""
    return ["--config-file" + token[len("--config_file"):] if token.startswith("--config_file") else token
            for token in rest]


if __name__ == "__main__":
    sys.exit(main())
