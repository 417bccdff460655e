"""The hooks of torchbay-deepspeed (entry point ``deepspeed`` in group ``torchbay``).

Nothing here imports deepspeed: the strategy module imports it when the strategy is built.
"""

from __future__ import annotations

import argparse
from typing import Any

from torchbay.plugin import LazyClass, add_section_options, hookimpl
from torchbay_deepspeed.config import DeepSpeedSection

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)


@hookimpl
def torchbay_register_strategies():
    return [LazyClass("torchbay_deepspeed.strategy:DeepSpeedStrategy", name="deepspeed")]


@hookimpl
def torchbay_config_sections():
    return {"deepspeed": DeepSpeedSection}


#: flag -> (section key, argparse kwargs)
CLI_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "--deepspeed-config-file": ("deepspeed_config_file", {"help": "DeepSpeed JSON config ('auto' values are filled)"}),
    "--zero-stage": ("zero_stage", {"type": int, "choices": [0, 1, 2, 3], "help": "DeepSpeed ZeRO stage"}),
    "--offload-optimizer-device": ("offload_optimizer_device", {"choices": ["none", "cpu", "nvme"]}),
    "--offload-optimizer-nvme-path": ("offload_optimizer_nvme_path", {}),
    "--offload-param-device": ("offload_param_device", {"choices": ["none", "cpu", "nvme"]}),
    "--offload-param-nvme-path": ("offload_param_nvme_path", {}),
    "--deepspeed-gradient-clipping": ("gradient_clipping", {"type": float, "help": "max gradient norm"}),
    "--zero3-init": ("zero3_init", {"action": "store_true", "help": "build models under deepspeed.zero.Init"}),
    "--zero3-save-16bit-model": ("zero3_save_16bit_model", {}),
}


@hookimpl
def torchbay_add_cli_options(parser: argparse.ArgumentParser, command: str) -> None:
    if command not in ("launch", "test"):
        return
    group = parser.add_argument_group("deepspeed (torchbay-deepspeed)")
    add_section_options(group, "deepspeed", DeepSpeedSection, flags=CLI_OPTIONS)


@hookimpl
def torchbay_report_env():
    import importlib.metadata as md

    try:
        version = md.version("deepspeed")
    except md.PackageNotFoundError:
        version = "not installed (pip install deepspeed)"
    return {"deepspeed": version}
