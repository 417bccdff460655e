"""Accelerate's surface, served by torchbay, for the libraries built on Accelerate (transformers, peft, trl, diffusers).

One switch turns it on: ``TORCHBAY_AS_ACCELERATE=1`` in the environment (read when Python starts, by the
``torchbay_as_accelerate.pth`` file installed with torchbay), ``torchbay launch --as-accelerate`` for its workers,
or :func:`as_accelerate` from code before those libraries are imported. Then ``import accelerate`` (modules and
distribution metadata) is answered by torchbay, whether or not the real Accelerate is installed; without the switch
nothing changes. The rest of the core never imports or names ``accelerate`` (docs/architecture.md, rule 12).
"""

from torchbay.switch.finder import ACCELERATE_API_LEVEL, SWITCH_ENV, as_accelerate, installed_finder, served_version

__all__ = ["ACCELERATE_API_LEVEL", "SWITCH_ENV", "as_accelerate", "installed_finder", "served_version"]
