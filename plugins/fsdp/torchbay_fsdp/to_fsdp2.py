"""``accelerate to-fsdp2`` under the switch: an Accelerate config's FSDP1 ``fsdp_config`` rewritten for FSDP2, into
a new file (torchbay never writes over a file it did not write, so ``--overwrite`` is refused). This plugin serves
the command and ``accelerate.commands.to_fsdp2`` (its accelerate.yaml, ``api: commands``).

What changes is torchbay's reading of FSDP1 keys (the fsdp plugin's accelerate.yaml): ``fsdp_sharding_strategy`` is
``fsdp_reshard_after_forward``; prefetching, flat-parameter and module-state-sync keys have no FSDP2 meaning."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import yaml

from torchbay.errors import ConfigError

logger = logging.getLogger(__name__)

#: FSDP1 keys with no FSDP2 meaning (dropped, each with a warning)
DROPPED = ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_sync_module_states", "fsdp_use_orig_params")
#: FSDP1 sharding strategies as FSDP2's reshard_after_forward
RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False,
           "NO_SHARD": False}


def convert_config_to_fsdp2(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``fsdp_config`` in FSDP2 terms (``fsdp_version: 2``); unchanged when already FSDP2."""
    fsdp = config.get("fsdp_config") or {}
    if not fsdp:
        logger.info("No FSDP config found in the config file, skipping conversion...")
        return config
    if fsdp.get("fsdp_version", 1) == 2:
        logger.warning("Config already specifies FSDP2, skipping conversion...")
        return config
    converted: dict[str, Any] = {}
    for key, value in fsdp.items():
        if key in DROPPED:
            logger.warning("%s has no FSDP2 meaning: dropped", key)
        elif key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
            converted["fsdp_reshard_after_forward"] = RESHARD.get(value, value)
        else:
            converted[key] = value
    converted["fsdp_version"] = 2
    config["fsdp_config"] = converted
    return config


def to_fsdp2_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelerate to-fsdp2 (served by torchbay)")
    parser.add_argument("--config_file", "--config-file", required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--output_file", "--output-file", default=None)
    return parser


def load_config(config_file: str) -> dict[str, Any]:
    try:
        with open(config_file, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {config_file}: {exc}", header="accelerate to-fsdp2") from exc
    if not config:
        raise ConfigError(f"{config_file} is empty", header="accelerate to-fsdp2")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file} must hold a mapping of Accelerate's keys to values",
                          header="accelerate to-fsdp2")
    return config


def to_fsdp2_command(args: argparse.Namespace) -> None:
    """Write the converted config to ``--output_file``, a new file (whether a file exists is asked of
    :class:`pathlib.Path`, as Accelerate's command does)."""
    if not Path(args.config_file).exists():
        raise FileNotFoundError(f"Config file {args.config_file} not found")
    if args.overwrite:
        raise ConfigError(f"--overwrite would write over {args.config_file}, which torchbay did not write: give "
                          "--output_file NEW.yaml instead", header="accelerate to-fsdp2")
    if args.output_file is None:
        raise ConfigError("give --output_file NEW.yaml (the converted config is written there)",
                          header="accelerate to-fsdp2")
    if Path(args.output_file).exists():
        raise FileExistsError(f"Output file {args.output_file} already exists: torchbay does not write over it")
    config = convert_config_to_fsdp2(load_config(args.config_file))
    with open(args.output_file, "x", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    """``accelerate to-fsdp2 ARGV`` (cli/accelerate/plugin_commands.py runs it)."""
    to_fsdp2_command(to_fsdp2_command_parser().parse_args(argv))
    return 0
