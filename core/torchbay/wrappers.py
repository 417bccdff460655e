"""Accelerate's ``accelerate.optimizer``/``accelerate.scheduler`` names (implemented in
:mod:`torchbay.accelerator.prepared`), and ``GradientState`` (:mod:`torchbay.data.gradient_state`)."""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "PreparedOptimizer": "torchbay.accelerator.prepared",
    "PreparedScheduler": "torchbay.accelerator.prepared",
    "AcceleratedOptimizer": "torchbay.accelerator.prepared",
    "AcceleratedScheduler": "torchbay.accelerator.prepared",
    "GradientState": "torchbay.data.gradient_state",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "GradientState", "PreparedOptimizer", "PreparedScheduler"]

if TYPE_CHECKING:
    from torchbay.accelerator.prepared import (
        AcceleratedOptimizer,
        AcceleratedScheduler,
        PreparedOptimizer,
        PreparedScheduler,
    )
    from torchbay.data.gradient_state import GradientState
# -- end of the names written by scripts/public_names.py --
