"""The torchbay plugin module of torchbay-fp8 (entry point ``fp8``).

Contributes the ``fp8`` config section and its ``--fp8-<key>`` flags (every key but
``engine_options``, which ``--set fp8.engine_options.<option>=...`` sets). The engines
themselves are registered by torchbay-fp8-te, torchbay-fp8-torchao and torchbay-fp8-msamp.
"""

from __future__ import annotations

from torchbay.plugin import add_section_options, hookimpl
from torchbay_fp8.config import FP8Config

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 0)


@hookimpl
def torchbay_config_sections():
    return {"fp8": FP8Config}


@hookimpl
def torchbay_add_cli_options(parser, command):
    if command == "estimate-memory":  # it estimates every precision; no FP8 setting changes its numbers
        return
    group = parser.add_argument_group("fp8 (mixed_precision: fp8; torchbay-fp8)")
    add_section_options(group, "fp8", FP8Config, skip={"engine_options"})
