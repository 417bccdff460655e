"""``accelerate tpu-config`` (served by this plugin under the switch): run set-up commands on every worker of a TPU
VM pod through the Google Cloud CLI, ``gcloud compute tpus tpu-vm ssh NAME --zone ZONE --command "..." --worker
all``, before ``accelerate launch`` runs there.

- Where: ``--tpu_name`` and ``--tpu_zone``, else ``tpu_name`` and ``tpu_zone`` of the Accelerate config file
  (``--config_file``, or Accelerate's default config file when it exists).
- What: ``--command CMD`` (repeatable; several words after one flag are several commands) or ``--command_file FILE``
  (one command a line; blank and ``#`` lines are skipped), else the config file's ``command_file`` or ``commands``.
  The commands run one after the other from ``/usr/share`` on each worker, after ``pip install`` of Hugging Face
  Accelerate when ``--install_accelerate`` (``--accelerate_version``: ``latest``, ``dev`` or a version), as
  Accelerate's command does.
- ``--debug`` prints the gcloud command instead of running it; otherwise gcloud runs as a list of arguments (no shell
  on this machine: the command string is the remote shell's only) and its exit code is the command's.

This plugin declares the command in its accelerate.yaml (``api: commands``), so this module also answers for
``accelerate.commands.tpu`` under the switch. Nothing here imports ``torch_xla``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from typing import Any

from torchbay.errors import ConfigError, LaunchError
from torchbay.plugin import default_config_file, load_config_from_file  # plugin API 1.2

__all__ = ["default_config_file", "gcloud_command", "load_config_from_file", "main", "pod_settings",
           "tpu_command_launcher", "tpu_command_parser"]

HEADER = "accelerate tpu-config"
#: where the commands run on each worker (Accelerate's choice: its users' command files rely on it)
WORKDIR = "/usr/share"
#: what ``--accelerate_version dev`` installs
ACCELERATE_DEV = "git+https://github.com/huggingface/accelerate.git"
#: a version pip can be asked for, with nothing the remote shell would read as syntax
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+!-]*")


def tpu_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Accelerate's ``accelerate tpu-config`` flags (a hyphen may replace each underscore)."""
    description = "Run set-up commands on every worker of a TPU VM pod (gcloud), before `accelerate launch` there."
    if subparsers is not None:
        parser = subparsers.add_parser("tpu-config", description=description)
    else:
        parser = argparse.ArgumentParser(prog="accelerate tpu-config (served by torchbay-xla)", description=description)
    pod = parser.add_argument_group("pod", "unset: read from the Accelerate config file")
    pod.add_argument("--config_file", "--config-file", default=None,
                     help="the Accelerate config file to read (default: Accelerate's default config file, if any)")
    pod.add_argument("--tpu_name", "--tpu-name", default=None, help="the TPU VM (pod) name")
    pod.add_argument("--tpu_zone", "--tpu-zone", default=None, help="its zone, e.g. us-central1-a")
    work = parser.add_argument_group("commands", "what runs on each worker, from /usr/share")
    work.add_argument("--command", action="append", nargs="+", default=None,
                      help="a command to run (repeat the flag for more)")
    work.add_argument("--command_file", "--command-file", default=None, help="a file of commands, one a line")
    work.add_argument("--install_accelerate", "--install-accelerate", action="store_true",
                      help="pip install Hugging Face Accelerate first")
    work.add_argument("--accelerate_version", "--accelerate-version", default="latest",
                      help="with --install_accelerate: latest, dev (its git main branch) or a version")
    work.add_argument("--use_alpha", "--use-alpha", action="store_true", help="run `gcloud alpha ...`")
    work.add_argument("--debug", action="store_true", help="print the gcloud command instead of running it")
    if subparsers is not None:
        parser.set_defaults(func=tpu_command_launcher)
    return parser


def _read_commands(path: str, where: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line.strip() for line in handle.read().splitlines()]
    except OSError as exc:
        raise ConfigError(f"{where} {path} cannot be read ({exc.strerror or exc}): give an existing file of "
                          "commands, one a line", header=HEADER) from None
    return [line for line in lines if line and not line.startswith("#")]


def _commands(args: argparse.Namespace, settings: dict[str, Any]) -> list[str]:
    """The flags' commands, else the config file's (its ``command_file`` before its ``commands``, as Accelerate)."""
    given = [word for words in (args.command or []) for word in words]
    if given and args.command_file:
        raise ConfigError("give --command or --command_file, not both", header=HEADER)
    if args.command_file:
        return _read_commands(args.command_file, "--command_file")
    if given:
        return given
    if settings.get("command_file"):
        return _read_commands(settings["command_file"], "the config file's command_file")
    configured = settings.get("commands")
    return [configured] if isinstance(configured, str) else [str(c) for c in configured or []]


def _install_step(version: str) -> str:
    if version == "latest":
        return "pip install accelerate -U"
    if version == "dev":
        return f"pip install {ACCELERATE_DEV}"
    if not _VERSION.fullmatch(version):
        raise ConfigError(f"--accelerate_version {version!r} is not a version: give latest, dev or a version such "
                          "as 1.15.0", header=HEADER)
    return f"pip install accelerate=={version}"


def pod_settings(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """The TPU name, its zone and the commands to run on each worker (the flags, then the Accelerate config
    file); every missing one is reported at once."""
    config_file = args.config_file
    if config_file is None and os.path.isfile(default_config_file):
        config_file = default_config_file
    settings = load_config_from_file(config_file).to_dict() if config_file else {}
    name = args.tpu_name or settings.get("tpu_name")
    zone = args.tpu_zone or settings.get("tpu_zone")
    commands = _commands(args, settings)
    where = config_file or "the Accelerate config file"
    missing = [problem for value, problem in (
        (name, f"no TPU named: give --tpu_name NAME (or tpu_name in {where})"),
        (zone, f"no zone: give --tpu_zone ZONE (or tpu_zone in {where})"),
        (commands, f"nothing to run: give --command CMD or --command_file FILE (or commands in {where})"))
        if not value]
    if missing:
        raise ConfigError(missing, header=HEADER)
    if args.install_accelerate:
        commands = [_install_step(args.accelerate_version), *commands]
    return str(name), str(zone), commands


def gcloud_command(name: str, zone: str, commands: list[str], use_alpha: bool = False) -> list[str]:
    """The gcloud argument list that runs ``commands`` (from /usr/share) on every worker of TPU ``name``."""
    remote = "; ".join([f"cd {WORKDIR}", *commands])
    return ["gcloud", *(["alpha"] if use_alpha else []), "compute", "tpus", "tpu-vm", "ssh", name, "--zone", zone,
            "--command", remote, "--worker", "all"]


def tpu_command_launcher(args: argparse.Namespace) -> int:
    """Run (or with ``--debug`` print) the gcloud command; its exit code."""
    command = gcloud_command(*pod_settings(args), use_alpha=args.use_alpha)
    if args.debug:
        print(f"Running {' '.join(command)}")
        return 0
    if shutil.which(command[0]) is None:
        raise LaunchError("gcloud (the Google Cloud CLI) is not on PATH: install it "
                          "(https://cloud.google.com/sdk/docs/install) and log in, or give --debug to print the "
                          "command instead")
    done = subprocess.run(command, check=False)
    if done.returncode:
        print(f"{HEADER}: gcloud failed with exit code {done.returncode}", file=sys.stderr)
        return done.returncode
    print("Successfully setup pod.")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``accelerate tpu-config ARGV`` (the command line's arguments when ``argv`` is None)."""
    return tpu_command_launcher(tpu_command_parser().parse_args(argv))
