"""Local SGD (Accelerate's ``accelerate.local_sgd.LocalSGD``): each process takes optimizer steps on its own, with
no gradient all-reduce, and the model's parameters are averaged across processes every ``local_sgd_steps`` steps
and when the block ends.

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            ...
            optimizer.step()
            local_sgd.step()

The parameters are replicated, so it needs a replicating strategy (``ddp``); with one process it does nothing.
Averaging is a collective: every process must call ``step()`` as often as the others.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from torchbay._lazy import attach
from torchbay.errors import ConfigError
from torchbay.process.state import DistributedType

_LAZY = {"Accelerator": "torchbay.accelerator.accelerator"}  # accelerate.local_sgd's names: imported on use
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["Accelerator", "DistributedType", "LocalSGD"]

if TYPE_CHECKING:
    from torchbay.accelerator.accelerator import Accelerator
# -- end of the names written by scripts/public_names.py --

#: strategies whose every process holds the whole model (the core's two)
REPLICATING_STRATEGIES = ("single", "ddp")


class LocalSGD:
    """Average ``model``'s parameters across processes every ``local_sgd_steps`` calls of :meth:`step`; inside
    the ``with`` block gradients are not synchronised (the strategy's ``no_sync``)."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        strategy = accelerator.strategy.name
        if strategy not in REPLICATING_STRATEGIES:
            raise ConfigError(f"LocalSGD averages replicated parameters, and strategy '{strategy}' shards or manages "
                              f"them itself; set strategy: ddp to use LocalSGD, or train without it")
        if int(local_sgd_steps) < 1:
            raise ConfigError(f"LocalSGD(local_sgd_steps={local_sgd_steps}): give a number of steps of at least 1")
        self.enabled = bool(enabled) and accelerator.num_processes > 1
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = int(local_sgd_steps)
        self._no_sync: contextlib.ExitStack | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = contextlib.ExitStack()
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.enabled:
            return
        try:
            if exc_info[0] is None:  # after an error the other processes may not reach this collective
                self._sync_and_avg_model_params()
        finally:
            no_sync, self._no_sync = self._no_sync, None
            if no_sync is not None:
                no_sync.__exit__(*exc_info)

    def step(self) -> None:
        """Count one optimizer step; every ``local_sgd_steps``-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    @torch.no_grad()
    def _sync_and_avg_model_params(self) -> None:
        """Replace every parameter by its mean over the processes (one all-reduce per parameter)."""
        self.accelerator.wait_for_everyone()
        for param in self.model.parameters():
            param.data.copy_(self.accelerator.reduce(param.data, reduction="mean"))

