"""``accelerate config`` / ``env`` / ``test`` / ``estimate-memory`` / ``to-fsdp2`` under the switch: Accelerate's
parsers and command functions (``accelerate.commands.env.env_command_parser``...), each running torchbay's command
of the same role (cli/config_cmd.py, cli/env.py, cli/test_cmd.py, cli/estimate_memory.py)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from shutil import which
from typing import Any

from torchbay.errors import ConfigError, ModelSourceError

__all__ = ["add_timm_hub_prefix", "config_main", "default_command_parser", "env_command", "env_command_parser",
           "estimate_command", "estimate_command_parser", "test_command", "test_command_parser", "which"]


def _torchbay(argv: list[str]) -> int:
    from torchbay.cli.main import main

    return main(argv)


# --- accelerate config -------------------------------------------------------------------------------------------

def default_command_parser(parser: Any = None, parents: Any = None) -> argparse.ArgumentParser:
    """``accelerate config default [--config_file F] [--mixed_precision P]``."""
    parser = argparse.ArgumentParser(prog="accelerate config default (served by torchbay)")
    parser.add_argument("--config_file", "--config-file", dest="save_location", default=None)
    parser.add_argument("--mixed_precision", "--mixed-precision", default="no",
                        choices=["no", "fp16", "bf16", "fp8"])
    return parser


def config_main(rest: list[str]) -> int:
    """``accelerate config [default|update] [--config_file F]``: ``default`` writes Accelerate's basic config
    (write_basic_config); without a subcommand torchbay's questionnaire writes F (default: Accelerate's default
    config file, which ``accelerate launch`` reads)."""
    from torchbay.compat.accelerate_config_file import default_config_file

    if rest[:1] == ["default"]:
        from torchbay.cli.accelerate.launch_helpers import write_basic_config

        args = default_command_parser().parse_args(rest[1:])
        written = write_basic_config(args.mixed_precision, args.save_location)
        if written:
            print(f"accelerate configuration saved at {written}")
        return 0
    if rest[:1] == ["update"]:
        raise ConfigError("accelerate config update rewrites an old Accelerate config file; torchbay reads every "
                          "Accelerate config as it is: see what it means with `torchbay config import-accelerate "
                          "FILE`", header="accelerate config update")
    parser = argparse.ArgumentParser(prog="accelerate config (served by torchbay)")
    parser.add_argument("--config_file", "--config-file", default=None)
    args = parser.parse_args(rest)
    output = args.config_file or default_config_file
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    return _torchbay(["config", "-o", output])


# --- accelerate env / test -----------------------------------------------------------------------------------------

def env_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelerate env (served by torchbay)")
    parser.add_argument("--config_file", "--config-file", default=None, help="the config to report")
    return parser


def env_command(args: argparse.Namespace) -> dict[str, Any]:
    """Print and return what Accelerate's ``accelerate env`` reports, followed by torchbay's own report."""
    import torch

    from torchbay.cli.env import collect
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.switch.finder import served_version

    report = collect(get_plugin_manager(), getattr(args, "config_file", None))
    info = {"`Accelerate` version": f"{served_version()} (served by torchbay)",
            "Platform": platform.platform(),
            "`accelerate` bash location": which("accelerate") or "Not found",
            "Python version": platform.python_version(),
            "PyTorch version": torch.__version__,
            "torchbay": report}
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    print("\n".join(f"- {key}: {value}" for key, value in info.items() if key != "torchbay"))
    _torchbay(["env"] + (["--config-file", args.config_file] if getattr(args, "config_file", None) else []))
    return info


def test_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelerate test (served by torchbay)")
    parser.add_argument("--config_file", "--config-file", default=None)
    return parser


def test_command(args: argparse.Namespace) -> None:
    """``torchbay test`` on the given config: a short real training; a failure is an error, as Accelerate's is."""
    code = _torchbay(["test", *(["--config-file", args.config_file] if args.config_file else [])])
    if code:
        raise SystemExit(code)
    print("Test is a success! You are ready for your distributed training!")


# --- accelerate estimate-memory ------------------------------------------------------------------------------------

def add_timm_hub_prefix(model_name: str) -> str:
    """A hub repo id (``org/name``) gets timm's ``hf-hub:`` source; a bare or already-prefixed name stays."""
    if "/" in model_name and ":" not in model_name:
        return "hf-hub:" + model_name
    return model_name


def estimate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelerate estimate-memory (served by torchbay)")
    parser.add_argument("model_name", help="a local safetensors checkpoint (file or folder) or pkg.module:factory")
    parser.add_argument("--library_name", choices=["timm", "transformers"], default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16", "int8", "int4"])
    parser.add_argument("--trust_remote_code", action="store_true")
    return parser


def estimate_command(args: argparse.Namespace) -> int:
    """``torchbay estimate-memory`` on a local checkpoint or a factory; a hub name is not downloaded."""
    name = args.model_name
    if ":" not in name and not os.path.exists(name):
        raise ModelSourceError(f"model {name!r} is not a local checkpoint: torchbay estimates memory from a "
                               "safetensors file or folder, or a pkg.module:factory, and downloads nothing; "
                               f"fetch it first (huggingface-cli download {name}) and give its folder")
    code = _torchbay(["estimate-memory", name])
    if code:
        sys.exit(code)
    return code
