"""The torchbay plugin module of torchbay-fp8-msamp (entry point ``fp8-msamp``).

Registers :class:`~torchbay_fp8_msamp.precision.MSAMPFP8Precision`, refuses set-ups MS-AMP
cannot run (DeepSpeed ZeRO-3, FSDP) before any process starts, and hands model and
optimizer to ``msamp.initialize`` in ``prepare``. Nothing here imports msamp.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from torchbay.plugins import hookimpl


def _selected(context) -> bool:
    cls = getattr(context, "precision_cls", None)
    return getattr(cls, "name", None) == "fp8" and getattr(cls, "fp8_backend", None) == "msamp"


@hookimpl
def torchbay_register_precisions():
    from torchbay_fp8_msamp.precision import MSAMPFP8Precision

    return [MSAMPFP8Precision]


@hookimpl
def torchbay_validate(context):
    if not _selected(context):
        return None
    from torchbay_fp8_msamp.precision import strategy_problems

    return strategy_problems(context.config)


@hookimpl
def torchbay_prepare(context, objects):
    precision = getattr(context, "precision", None)
    if getattr(precision, "fp8_backend", None) != "msamp":
        return None
    return precision.initialize(objects)


@hookimpl
def torchbay_report_env():
    if importlib.util.find_spec("msamp") is None:
        return {"fp8 msamp": "not installed (MS-AMP is not on PyPI; see torchbay-fp8-msamp's README)"}
    try:
        return {"fp8 msamp": importlib.metadata.version("msamp")}
    except importlib.metadata.PackageNotFoundError:
        return {"fp8 msamp": "installed (version unknown)"}
