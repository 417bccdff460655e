"""``torchbay``: entry point. Each subcommand lives in its own module with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from torchbay.errors import TorchbayError

#: subcommand modules under torchbay.cli, each with ``register(subparsers)``
COMMAND_MODULES = ("launch", "config_cmd", "env", "plugins_cmd", "test_cmd", "estimate_memory", "new_plugin",
                   "plot")


def apply_plugin_flags(argv: list[str]) -> list[str]:
    """Consume leading ``-p NAME`` / ``-p no:NAME`` (as pytest has) into the plugin env vars.

    They go into ``TORCHBAY_PLUGINS`` / ``TORCHBAY_BLOCK_PLUGINS`` so that workers started by
    ``torchbay launch`` see the same plugins. Only options before the command are read.
    """
    load, block = [], []
    while argv and (argv[0] == "-p" or (argv[0].startswith("-p") and not argv[0].startswith("--"))):
        if argv[0] == "-p":
            if len(argv) < 2:
                print("torchbay: error: -p needs a plugin name (-p NAME or -p no:NAME)", file=sys.stderr)
                raise SystemExit(2)
            value, argv = argv[1], argv[2:]
        else:
            value, argv = argv[0][2:], argv[1:]
        (block if value.startswith("no:") else load).append(value.removeprefix("no:"))
    for var, names in (("TORCHBAY_PLUGINS", load), ("TORCHBAY_BLOCK_PLUGINS", block)):
        if names:
            current = [n for n in os.environ.get(var, "").split(",") if n]
            os.environ[var] = ",".join(current + names)
    if load or block:
        from torchbay.registry.manager import reset_plugin_manager

        reset_plugin_manager(None)
    return argv


class Parser(argparse.ArgumentParser):
    """Every torchbay parser: no abbreviated options (``--nproc`` after the script is the
    script's, never a guess at ``--nproc-per-node``). Sub-parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """One line, exit code 2 (argparse would print the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from torchbay.registry.manager import get_plugin_manager

    parser = Parser(prog="torchbay", description="Run your own PyTorch loop on any device, strategy and precision.")
    parser.add_argument("-p", dest="plugin_flags", action="append", metavar="NAME",
                        help="load plugin NAME (an entry-point name or an importable module), or block it "
                             "with -p no:NAME; give before the command, may repeat")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"torchbay.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"torchbay.cli.{name}":
                continue  # command not built yet
            raise
        module.register(subparsers)
    pm = get_plugin_manager()
    pm.hook.torchbay_add_commands.call_historic(kwargs={"subparsers": subparsers})
    try:  # surface every plugin failure now (one warning each), so that --help can list them too
        pm.registries()
        pm.config_sections()
    except TorchbayError:
        pass
    failed = pm.failed_plugins()
    if failed:
        parser.epilog = ("plugins that failed and are disabled for this run: " +
                         ", ".join(f"{i.name} ({i.distribution}, {i.hook}: {i.error})" for i in failed) +
                         "; see torchbay plugins")
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``argv`` names: ``config show`` -> its own parser."""
    for token in argv:
        inner = _subparser(parser, token)
        if inner is not None:
            parser = inner
    return parser


#: the commands that read ``accelerate launch``'s flags: they take the same settings
ACCELERATE_SPELLINGS = (("launch",), ("config", "show"))


def with_accelerate_spellings(parser: argparse.ArgumentParser, argv: list[str],
                              origins: dict[str, str] | None = None) -> list[str]:
    """``torchbay launch`` (and ``config show``) read ``accelerate launch``'s flags (cli/accelerate_flags.py);
    ``origins`` receives ``{torchbay key: the Accelerate flag that set it}``."""
    from torchbay.cli.accelerate_flags import AccelerateLaunchFlags

    for command in ACCELERATE_SPELLINGS:  # (apply_plugin_flags took the -p options before the command)
        if tuple(argv[:len(command)]) == command:
            inner = _command_parser(parser, list(command))
            flags = AccelerateLaunchFlags(inner)
            translated = argv[:len(command)] + flags.translate(argv[len(command):])
            if origins is not None:
                origins.update(flags.origins)
            return translated
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = apply_plugin_flags(list(sys.argv[1:] if argv is None else argv))
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        parser = build_parser()
        origins: dict[str, str] = {}
        imported = None
        if argv[:1] == ["launch"]:  # an Accelerate config file is read as `config import-accelerate` reads it
            from torchbay.compat.accelerate_config_file import with_torchbay_config

            rest, imported = with_torchbay_config(argv[1:])
            argv = ["launch", *rest]
        argv = with_accelerate_spellings(parser, argv, origins)
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            from torchbay.cli.accelerate_flags import unknown_option_message

            failing = _command_parser(parser, argv)
            failing.error(unknown_option_message(failing, unknown))
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        command = args.command
        args._argv = argv
        args._flag_origins = origins
        args._imported_config = imported
        return int(args.func(args) or 0)
    except TorchbayError as exc:
        print(f"torchbay {command}: error: {exc}".replace("torchbay : ", "torchbay: "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `torchbay config show | head`: the reader has all it wanted
        return _reader_went_away()


def _reader_went_away() -> int:
    """Send what is left of stdout nowhere (so that its flush at exit does not fail again) and
    exit as a command killed by SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
