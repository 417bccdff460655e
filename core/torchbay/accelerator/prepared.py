"""What ``prepare`` returns for optimizers and schedulers.

A prepared optimizer steps only when gradients are synchronised (the last micro-batch of
an accumulation window), through the selected precision (loss scaler) and strategy.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from torchbay.errors import TorchbayError


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; ``step``/``zero_grad`` act only on sync micro-batches."""

    def __init__(self, optimizer: Any, accelerator):  # noqa: D107 (Optimizer.__init__ not called on purpose)
        self.optimizer = optimizer
        self.accelerator = accelerator
        self._is_overflow = False  # Accelerate's name for step_was_skipped (tests and libraries set it)
        self.gradients_unscaled = False  # until the next step: unscaling twice would be wrong

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (the loss scaler found inf/nan gradients)."""
        return self._is_overflow

    @step_was_skipped.setter
    def step_was_skipped(self, value: bool) -> None:
        self._is_overflow = bool(value)

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def train(self) -> None:
        """The optimizer's train mode, for optimizers that have one (schedule-free ones); else nothing."""
        _call_mode(self.optimizer, "train")

    def eval(self) -> None:
        """The optimizer's eval mode, for optimizers that have one (schedule-free ones); else nothing."""
        _call_mode(self.optimizer, "eval")

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool | None = None):
        if not self.accelerator.gradient_state.sync_gradients:
            return
        if "set_to_none" in inspect.signature(self.optimizer.zero_grad).parameters:
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        elif set_to_none is not None:
            raise TorchbayError(f"optimizer.zero_grad(set_to_none=...): {type(self.optimizer).__name__}.zero_grad "
                                f"takes no set_to_none; call zero_grad() without it")
        else:
            self.optimizer.zero_grad()

    def step(self, closure=None):
        acc = self.accelerator
        if not acc.gradient_state.sync_gradients:
            return None
        kwargs = {} if closure is None else {"closure": closure}
        try:
            stepped = acc.precision.optimizer_step(self.optimizer, acc.strategy.optimizer_step, **kwargs)
        except RuntimeError as exc:  # an out-of-memory error says what the memory held
            getattr(acc, "explain_oom", lambda _: None)(exc)
            raise
        self.step_was_skipped = not stepped
        self.gradients_unscaled = False
        if stepped:
            acc.precision.after_optimizer_step(self.optimizer)
        acc.device_backend.after_step()
        telemetry = getattr(acc, "telemetry", None)
        if telemetry is not None:
            telemetry.after_optimizer_step(self)
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

    def __getattr__(self, name: str):
        """Other attributes and methods of the user's optimizer pass through (its own extras)."""
        if name.startswith("__") or name == "optimizer":  # unpickling looks these up before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def _call_mode(optimizer: Any, mode: str) -> None:
    """``optimizer.train()``/``eval()`` where it (or the optimizer it wraps) has the method."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        method = getattr(candidate, mode, None)
        if callable(method):
            method()
            return


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
