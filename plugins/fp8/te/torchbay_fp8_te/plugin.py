"""The torchbay plugin module of torchbay-fp8-te (entry point ``fp8-te``).

Registers :class:`~torchbay_fp8_te.precision.TransformerEngineFP8Precision` and saves /
restores each rank's FP8 scaling state (amax history and scales of every TE module) with
``save_state`` / ``load_state``. Nothing here imports transformer_engine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from torchbay.plugins import hookimpl

STATE_KEY = "fp8_te"


def _te_precision(context):
    precision = getattr(context, "precision", None)
    return precision if getattr(precision, "fp8_backend", None) == "te" else None


@hookimpl
def torchbay_register_precisions():
    from torchbay_fp8_te.precision import TransformerEngineFP8Precision

    return [TransformerEngineFP8Precision]


@hookimpl
def torchbay_state_extra(context):
    precision = _te_precision(context)
    if precision is None:
        return None
    return {STATE_KEY: precision.scaling_state()}


@hookimpl
def torchbay_load_state_extra(context, state):
    precision = _te_precision(context)
    if precision is None:
        return
    from torchbay.errors import CheckpointError

    if STATE_KEY not in state:
        raise CheckpointError("fp8 (te): the checkpoint holds no Transformer Engine FP8 scaling state "
                              f"(plugin state key '{STATE_KEY}'); was it saved with fp8.backend: te?")
    precision.load_scaling_state(state[STATE_KEY])


@hookimpl
def torchbay_report_env():
    if importlib.util.find_spec("transformer_engine") is None:
        return {"fp8 te": "not installed (pip install 'torchbay-fp8-te[engine]')"}
    try:
        return {"fp8 te": importlib.metadata.version("transformer_engine")}
    except importlib.metadata.PackageNotFoundError:
        return {"fp8 te": "installed (version unknown)"}
