"""What ``prepare`` returns for optimizers and schedulers.

A prepared optimizer steps only when gradients are synchronised (the last micro-batch of
an accumulation window), through the selected precision (loss scaler) and strategy.
"""

from __future__ import annotations

from typing import Any

import torch


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
