"""The torchbay plugin module of torchbay-fp8-te (entry point ``fp8-te``).

Registers :class:`~torchbay_fp8_te.precision.TransformerEngineFP8Precision`, which saves each
rank's FP8 scaling state (amax history and scales of every TE module) as its per-rank
precision state. Nothing here imports transformer_engine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from torchbay.plugin import LazyClass, hookimpl

#: the torchbay plugin API this plugin was written for (torchbay.plugin.API_VERSION)
TORCHBAY_PLUGIN_API = (1, 1)


@hookimpl
def torchbay_register_precisions():
    return [LazyClass("torchbay_fp8_te.precision:TransformerEngineFP8Precision", name="fp8", engine="te"),
            LazyClass("torchbay_fp8_te.precision:TransformerEngineFP4Precision", name="fp4", engine="te")]


@hookimpl
def torchbay_report_env():
    if importlib.util.find_spec("transformer_engine") is None:
        return {"fp8 te": "not installed (pip install 'torchbay-fp8-te[engine]')"}
    try:
        return {"fp8 te": importlib.metadata.version("transformer_engine")}
    except importlib.metadata.PackageNotFoundError:
        return {"fp8 te": "installed (version unknown)"}
