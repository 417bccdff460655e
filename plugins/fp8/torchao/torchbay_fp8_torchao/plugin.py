"""The torchbay plugin module of torchbay-fp8-torchao (entry point ``fp8-torchao``).

Registers :class:`~torchbay_fp8_torchao.precision.TorchaoFP8Precision` and, for ``mixed_precision: fp4``
(MXFP4), :class:`~torchbay_fp8_torchao.precision.TorchaoFP4Precision` (which, under FSDP2
with float8 all-gather, precomputes the weights' FP8 scales after every optimizer step).
Nothing here imports torchao.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from torchbay.plugin import LazyClass, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)


@hookimpl
def torchbay_register_precisions():
    return [LazyClass("torchbay_fp8_torchao.precision:TorchaoFP8Precision", name="fp8", engine="torchao"),
            LazyClass("torchbay_fp8_torchao.precision:TorchaoFP4Precision", name="fp4", engine="torchao")]


@hookimpl
def torchbay_report_env():
    if importlib.util.find_spec("torchao") is None:
        return {"fp8 torchao": "not installed (pip install torchao)"}
    return {"fp8 torchao": importlib.metadata.version("torchao")}
