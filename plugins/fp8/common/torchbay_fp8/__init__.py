"""torchbay-fp8: what the FP8 engine plugins share (no engine of its own).

- :class:`~torchbay_fp8.config.FP8Config`: the ``fp8`` config section, registered by this
  distribution's plugin module (entry point ``fp8``) with its ``--fp8-*`` flags;
- :class:`~torchbay_fp8.precision.FP8Precision`: the base of every engine's precision;
- :mod:`torchbay_fp8.linears`: which ``nn.Linear`` modules to convert, and the
  "too small to gain" warning.

Importing it imports nothing: each name is imported from its module when first read, so the plugin
module (which needs only the config section) leaves the precision base unimported in a run without FP8.
"""

import importlib

__version__ = "0.1.0"
_SOURCES = {"FP8Config": "torchbay_fp8.config", "FP8Precision": "torchbay_fp8.precision",
            **dict.fromkeys(["LinearPlan", "fp8_gemm_shape", "plan_linears", "small_layers", "warn_small_layers"],
                            "torchbay_fp8.linears")}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    if name in _SOURCES:
        return getattr(importlib.import_module(_SOURCES[name]), name)
    raise AttributeError(f"module 'torchbay_fp8' has no attribute {name!r}")
