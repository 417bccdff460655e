"""torchbay-fp8: what the FP8 engine plugins share (no engine of its own).

- :class:`~torchbay_fp8.config.FP8Config`: the ``fp8`` config section, registered by this
  distribution's plugin module (entry point ``fp8``) with its ``--fp8-*`` flags;
- :class:`~torchbay_fp8.precision.FP8Precision`: the base of every engine's precision;
- :mod:`torchbay_fp8.linears`: which ``nn.Linear`` modules to convert, and the
  "too small to gain" warning.

Importing it imports torch and torchbay only, never an FP8 engine.
"""

from torchbay_fp8.config import FP8Config
from torchbay_fp8.linears import LinearPlan, plan_linears, small_layers, warn_small_layers
from torchbay_fp8.precision import FP8Precision

__version__ = "0.1.0"
__all__ = ["FP8Config", "FP8Precision", "LinearPlan", "plan_linears", "small_layers", "warn_small_layers"]
