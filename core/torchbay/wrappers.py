"""What ``prepare`` returns for optimizers and schedulers, and the gradient-sync state.

A prepared optimizer steps only when gradients are synchronised (the last micro-batch of
an accumulation window), through the selected precision (loss scaler) and strategy.
"""

from __future__ import annotations

from typing import Any

import torch


class GradientState:
    """Whether this micro-batch synchronises gradients, and where the data loader is.

    One per ``Accelerator``; ``GradientState()`` without arguments gives the latest Accelerator's
    (Accelerate's is one per process). It has Accelerate's attribute names (``num_steps``,
    ``active_dataloader``, ``in_dataloader``...).
    """

    def __new__(cls, accumulation_steps: Any = None, sync_each_batch: bool = False):
        if accumulation_steps is None:  # Accelerate's GradientState(): the latest Accelerator's
            from torchbay.state import PartialState

            current = PartialState._shared_state.get("_gradient_state")
            if isinstance(current, cls):
                return current
        return super().__new__(cls)

    def __init__(self, accumulation_steps: Any = None, sync_each_batch: bool = False):
        if accumulation_steps is None and getattr(self, "_ready", False):
            return  # the shared one, as it is
        self._ready = True
        self._adjust_scheduler = True
        if hasattr(accumulation_steps, "num_steps"):  # Accelerate's GradientState(gradient_accumulation_plugin)
            sync_each_batch = getattr(accumulation_steps, "sync_each_batch", False)
            self._adjust_scheduler = getattr(accumulation_steps, "adjust_scheduler", True)
            accumulation_steps = accumulation_steps.num_steps
        self.accumulation_steps = int(accumulation_steps or 1)
        self.sync_each_batch = sync_each_batch
        self.step = 0
        self.sync_gradients = True
        self._end_of_dataloader = False  # without an active loader
        self._remainder = -1
        self._active_loaders: list[Any] = []

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active loader is serving its last batch."""
        loader = self.active_dataloader
        return loader._end_of_dataloader if loader is not None else self._end_of_dataloader

    @end_of_dataloader.setter
    def end_of_dataloader(self, value: bool) -> None:
        loader = self.active_dataloader
        if loader is not None:
            loader._end_of_dataloader = value
        else:
            self._end_of_dataloader = value

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's last round (-1: all real), for ``gather_for_metrics``."""
        loader = self.active_dataloader
        return loader._remainder if loader is not None else self._remainder

    @remainder.setter
    def remainder(self, value: int) -> None:
        loader = self.active_dataloader
        if loader is not None:
            loader._remainder = value
        else:
            self._remainder = value

    @property
    def num_steps(self) -> int:
        return self.accumulation_steps

    @property
    def sync_with_dataloader(self) -> bool:
        return True

    @property
    def adjust_scheduler(self) -> bool:
        return self._adjust_scheduler

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The gradient-accumulation settings under Accelerate's ``GradientAccumulationPlugin`` names."""
        return {"num_steps": self.num_steps, "adjust_scheduler": self.adjust_scheduler,
                "sync_with_dataloader": self.sync_with_dataloader, "sync_each_batch": self.sync_each_batch}

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Decide by hand whether this micro-batch synchronises (a loop that accumulates by itself, as
        transformers' Trainer does, instead of calling ``accumulate``)."""
        self.sync_gradients = bool(sync_gradients)

    @property
    def active_dataloader(self) -> Any:
        return self._active_loaders[-1] if self._active_loaders else None

    @property
    def dataloader_references(self) -> list[Any]:
        return [None, *self._active_loaders]

    @property
    def in_dataloader(self) -> bool:
        return bool(self._active_loaders)

    @property
    def initialized(self) -> bool:
        return True

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's reset of its process-wide gradient state; each torchbay Accelerator has its own."""

    def __repr__(self) -> str:
        return (f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
                f"Extra samples added: {self.remainder}\nGradient accumulation steps: {self.num_steps}\n")

    def advance(self) -> bool:
        """Called by ``accumulate``: decide whether this micro-batch syncs."""
        if self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.accumulation_steps == 0
        return self.sync_gradients

    def begin_dataloader(self, loader) -> None:
        loader._end_of_dataloader, loader._remainder = False, -1
        self._active_loaders.append(loader)

    def end_dataloader(self, loader) -> None:
        loader._end_of_dataloader, loader._remainder = False, -1
        if any(d is loader for d in self._active_loaders):
            self._active_loaders = [d for d in self._active_loaders if d is not loader]


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; ``step``/``zero_grad`` act only on sync micro-batches."""

    def __init__(self, optimizer: Any, accelerator):  # noqa: D107 (Optimizer.__init__ not called on purpose)
        self.optimizer = optimizer
        self.accelerator = accelerator
        self.step_was_skipped = False
        self.gradients_unscaled = False  # until the next step: unscaling twice would be wrong

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        if self.accelerator.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        acc = self.accelerator
        if not acc.gradient_state.sync_gradients:
            return None
        kwargs = {} if closure is None else {"closure": closure}
        stepped = acc.precision.optimizer_step(self.optimizer, acc.strategy.optimizer_step, **kwargs)
        self.step_was_skipped = not stepped
        self.gradients_unscaled = False
        if stepped:
            acc.precision.after_optimizer_step(self.optimizer)
        acc.device_backend.after_step()
        return None

    def unscale_gradients(self) -> None:
        """Turn the loss-scaled gradients into true values, once per step (before clipping)."""
        if not self.gradients_unscaled:
            self.accelerator.precision.unscale_gradients(self.optimizer)
            self.gradients_unscaled = True

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)


class PreparedScheduler:
    """Steps the user's scheduler once per real optimizer step, as Accelerate does.

    Without ``split_batches`` it steps ``num_processes`` times per optimizer step, so a
    schedule written for the single-process number of batches keeps its shape.
    """

    def __init__(self, scheduler: Any, optimizers: list[PreparedOptimizer], accelerator):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.accelerator = accelerator

    def step(self, *args, **kwargs):
        acc = self.accelerator
        if not acc.config.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not acc.gradient_state.sync_gradients:
            if acc.gradient_state.adjust_scheduler:  # as Accelerate: the micro-batch counts for the scheduler
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        times = 1 if acc.config.dataloader.split_batches else acc.num_processes
        total = getattr(self.scheduler, "total_steps", None)
        for _ in range(times):
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


#: Accelerate's names (accelerate.optimizer / accelerate.scheduler)
AcceleratedOptimizer = PreparedOptimizer
AcceleratedScheduler = PreparedScheduler
