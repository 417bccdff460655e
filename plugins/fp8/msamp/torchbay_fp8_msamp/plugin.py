"""The torchbay plugin module of torchbay-fp8-msamp (entry point ``fp8-msamp``).

Registers :class:`~torchbay_fp8_msamp.precision.MSAMPFP8Precision`; once selected, its
``check`` refuses set-ups MS-AMP cannot run (DeepSpeed ZeRO-3, FSDP) before any process
starts and its ``prepare`` hands model and optimizer to ``msamp.initialize``. Nothing here
imports msamp.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from torchbay.plugin import LazyClass, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)


@hookimpl
def torchbay_register_precisions():
    return [LazyClass("torchbay_fp8_msamp.precision:MSAMPFP8Precision", name="fp8", engine="msamp")]


@hookimpl
def torchbay_report_env():
    if importlib.util.find_spec("msamp") is None:
        return {"fp8 msamp": "not installed (MS-AMP is not on PyPI; see torchbay-fp8-msamp's README)"}
    try:
        return {"fp8 msamp": importlib.metadata.version("msamp")}
    except importlib.metadata.PackageNotFoundError:
        return {"fp8 msamp": "installed (version unknown)"}
