"""Accelerate's ``accelerate.launchers`` path (implemented in :mod:`torchbay.launch.notebook`).
"""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "debug_launcher": "torchbay.launch.notebook",
    "notebook_launcher": "torchbay.launch.notebook",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["debug_launcher", "notebook_launcher"]

if TYPE_CHECKING:
    from torchbay.launch.notebook import debug_launcher, notebook_launcher
# -- end of the names written by scripts/public_names.py --
