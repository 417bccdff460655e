"""Accelerate's ``accelerate.state`` path: the process and run state classes (implemented in
:mod:`torchbay.process.state` and :mod:`torchbay.data.gradient_state`)."""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "AcceleratorState": "torchbay.process.state",
    "DistributedType": "torchbay.process.state",
    "PartialState": "torchbay.process.state",
    "GradientState": "torchbay.data.gradient_state",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]

if TYPE_CHECKING:
    from torchbay.data.gradient_state import GradientState
    from torchbay.process.state import AcceleratorState, DistributedType, PartialState
# -- end of the names written by scripts/public_names.py --
