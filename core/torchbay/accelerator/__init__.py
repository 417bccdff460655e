"""The user's API: :class:`Accelerator` (Accelerate's ``accelerate.accelerator`` path) and the parts it composes:
``prepare`` (what ``prepare`` does per object), ``prepared`` (the optimizer and scheduler wrappers),
``process`` (collectives and the breakpoint trigger), ``tracking`` (the tracker methods, over the run's
``torchbay.tracking.run.RunTracking``), ``checkpointed`` (the prepared objects and training state given to the
checkpointer), ``surface`` (Accelerate-only arguments); the Accelerate-only properties are in
``torchbay.compat.accelerator_views``.
"""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "Accelerator": "torchbay.accelerator.accelerator",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["Accelerator"]

if TYPE_CHECKING:
    from torchbay.accelerator.accelerator import Accelerator
# -- end of the names written by scripts/public_names.py --
