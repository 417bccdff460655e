"""The torchbay-fsdp plugin module (entry point ``fsdp`` in group ``torchbay``).

Cheap to import: it imports neither ``torch.distributed.fsdp`` nor
``torch.distributed.checkpoint`` (the strategy imports them when it is built), nor the strategy
(named by a :class:`~torchbay.plugin.LazyClass`) nor the ``merge-weights`` command (imported when the
CLI asks for the plugin's commands): the plugin manager imports this module in every torchbay process.
"""

from __future__ import annotations

import argparse
import json

import torch

from torchbay.plugin import SCHEDULES, LazyClass, add_section_options, hookimpl
from torchbay_fsdp import __version__
from torchbay_fsdp.config import FSDPConfig, ParallelismSection

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)

#: CLI flag -> (config key, argparse keywords on top of the generated ones: add_section_options)
_FLAGS = {
    "--fsdp-version": ("version", {"type": int, "choices": [1, 2]}),
    "--fsdp-wrap-policy": ("wrap_policy", {"choices": ["transformer", "size", "none"]}),
    "--fsdp-transformer-layer-cls-to-wrap": ("transformer_layer_cls_to_wrap", {"metavar": "CLS[,CLS...]"}),
    "--fsdp-min-num-params": ("min_num_params", {"type": int}),
    "--fsdp-reshard-after-forward": ("reshard_after_forward", {"action": argparse.BooleanOptionalAction}),
    "--fsdp-backward-prefetch": ("backward_prefetch", {"choices": ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]}),
    "--fsdp-cpu-offload": ("cpu_offload", {"action": argparse.BooleanOptionalAction}),
    "--fsdp-activation-checkpointing": ("activation_checkpointing", {"action": argparse.BooleanOptionalAction}),
    "--fsdp-cpu-ram-efficient-loading": ("cpu_ram_efficient_loading", {"action": argparse.BooleanOptionalAction}),
    "--fsdp-param-dtype": ("param_dtype", {"choices": ["auto", "float32", "bfloat16", "float16"]}),
    "--fsdp-reduce-dtype": ("reduce_dtype", {"choices": ["auto", "float32", "bfloat16", "float16"]}),
}


def _tp_plan(value: str) -> dict:
    """``PATTERN=STYLE[,PATTERN=STYLE...]`` (or a JSON object) -> a plan."""
    if value.strip().startswith("{"):
        return json.loads(value)
    plan = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        pattern, sep, style = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} is not PATTERN=STYLE")
        plan[pattern.strip()] = style.strip()
    return plan


#: N-D parallel flags -> (key of the parallelism section, argparse keyword arguments)
_PARALLEL_FLAGS = {
    "--dp-replicate-size": ("dp_replicate_size", {"type": int}),
    "--dp-shard-size": ("dp_shard_size", {"type": int}),
    "--tp-size": ("tp_size", {"type": int}),
    "--cp-size": ("cp_size", {"type": int}),
    "--sp-size": ("sp_size", {"type": int}),
    "--sp-attn-implementation": ("sp_attn_implementation", {}),
    "--sp-seq-length": ("sp_seq_length", {"type": int}),
    "--ep-size": ("ep_size", {"type": int}),
    "--ep-plan": ("ep_plan", {"metavar": "PATTERN[,PATTERN...]"}),
    "--cp-comm-strategy": ("cp_comm_strategy", {"choices": ["allgather", "alltoall"]}),
    "--tp-plan": ("tp_plan", {"type": _tp_plan, "metavar": "PATTERN=STYLE[,...]"}),
    "--pp-size": ("pp_size", {"type": int}),
    "--pp-schedule": ("pp_schedule", {"choices": list(SCHEDULES)}),
    "--pp-microbatches": ("pp_microbatches", {"type": int}),
    "--pp-virtual-stages": ("pp_virtual_stages", {"type": int}),
    "--pp-split-points": ("pp_split_points", {"metavar": "BLOCK[,BLOCK...]"}),
}


@hookimpl
def torchbay_register_strategies():
    return [LazyClass("torchbay_fsdp.strategy:FSDPStrategy", name="fsdp")]


@hookimpl
def torchbay_config_sections():
    return {"fsdp": FSDPConfig, "parallelism": ParallelismSection}


@hookimpl
def torchbay_add_cli_options(parser, command):
    if command == "estimate-memory":  # per-rank memory for the given parallel sizes (the stage placement: --set)
        _add_parallel_flags(parser, skip=("--pp-microbatches", "--pp-virtual-stages", "--pp-split-points",
                                          "--pp-schedule", "--sp-attn-implementation", "--sp-seq-length"))
    if command not in ("launch", "test"):
        return
    add_section_options(parser.add_argument_group("fsdp (strategy: fsdp)"), "fsdp", FSDPConfig, flags=_FLAGS)
    _add_parallel_flags(parser)


def _add_parallel_flags(parser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("N-D parallelism (strategy: fsdp; the parallelism section, docs/parallelism.md)")
    flags = {flag: spec for flag, spec in _PARALLEL_FLAGS.items() if flag not in skip}
    add_section_options(group, "parallelism", ParallelismSection, flags=flags)


@hookimpl
def torchbay_add_commands(subparsers):
    from torchbay_fsdp.merge import register  # the command's module loads the checkpoint machinery: CLI only

    register(subparsers)


@hookimpl
def torchbay_report_env():
    return {"fsdp": f"torchbay-fsdp {__version__}: FSDP2 (fully_shard) with torch {torch.__version__}; "
                    f"FSDP1 needs an accelerator; N-D parallelism: pp (torch.distributed.pipelining: "
                    f"{', '.join(SCHEDULES)}), dp_replicate (HSDP), dp_shard, tp, cp (cp needs an accelerator), "
                    f"sp (Ulysses), ep (experts over dp_shard ranks)"}

