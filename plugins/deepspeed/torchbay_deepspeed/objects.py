"""Objects ``prepare`` hands back under DeepSpeed, and the placeholders users prepare.

Nothing here imports deepspeed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torchbay.errors import TorchbayError
from torchbay.plugin import PreparedScheduler


class DummyOptim(torch.optim.Optimizer):
    """Stands for the optimizer defined in the DeepSpeed JSON (``"optimizer"`` section).

    Prepare it with its model; its ``lr`` / ``weight_decay`` fill that section's ``"auto"``
    values. ``prepare`` returns an optimizer whose ``step``/``zero_grad`` the loop may call
    as usual (DeepSpeed steps inside ``accelerator.backward``).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, **kwargs: Any):
        params = list(params)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, **kwargs})
        # Accelerate's attributes
        self.params, self.lr, self.weight_decay, self.kwargs = params, lr, weight_decay, kwargs

    def step(self, closure=None):  # pragma: no cover - replaced by prepare
        raise TorchbayError("DummyOptim stands for DeepSpeed's optimizer: pass it to accelerator.prepare")


class DummyScheduler:
    """Stands for the scheduler of the DeepSpeed JSON (``"scheduler"`` section), or for
    ``lr_scheduler_callable(optimizer)`` built by DeepSpeed. Its keyword arguments fill that
    section's ``"auto"`` params (``total_num_steps``, ``warmup_num_steps``, ...);
    ``warmup_max_lr`` defaults to the optimizer's lr. Prepare it in the same call as its model.
    """

    def __init__(self, optimizer: Any, total_num_steps: Optional[int] = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Optional[Callable] = None, **kwargs: Any):
        self.optimizer = optimizer
        self.lr_scheduler_callable = lr_scheduler_callable
        # Accelerate's attributes
        self.total_num_steps, self.warmup_num_steps, self.kwargs = total_num_steps, warmup_num_steps, kwargs
        self.params = {"total_num_steps": total_num_steps, "warmup_num_steps": warmup_num_steps, **kwargs}
        lr = optimizer.defaults.get("lr") if hasattr(optimizer, "defaults") else None
        self.params.setdefault("warmup_max_lr", lr)
        self.params.setdefault("warmup_min_lr", 0)
        self.params = {k: v for k, v in self.params.items() if v is not None}

    def step(self, *args, **kwargs):  # pragma: no cover - replaced by prepare
        raise TorchbayError("DummyScheduler stands for DeepSpeed's scheduler: pass it to accelerator.prepare")


class EngineOptimizer:
    """The optimizer ``prepare`` returns: the engine owns the real step.

    ``accelerator.backward`` runs ``engine.backward`` and ``engine.step`` (DeepSpeed applies
    the update on the last micro-batch of an accumulation window and zeroes the gradients);
    ``step``/``zero_grad`` here do nothing, so an unchanged DDP loop gives the same updates.
    ``param_groups`` are the user's (a torch scheduler on the user's optimizer keeps working).
    """

    def __init__(self, user_optimizer: Any):
        self.user_optimizer = user_optimizer
        self.engine = None

    def _live(self):
        if self.engine is not None and (self.user_optimizer is None or isinstance(self.user_optimizer, DummyOptim)):
            return self.engine.optimizer
        return self.user_optimizer

    @property
    def param_groups(self):
        return self._live().param_groups

    @property
    def state(self):
        return self._live().state

    @property
    def defaults(self):
        return getattr(self._live(), "defaults", {})

    def add_param_group(self, group):
        raise TorchbayError("add_param_group after prepare is not supported under DeepSpeed; add the group first")

    def zero_grad(self, set_to_none: bool = True):
        if self.engine is None:
            raise TorchbayError("this optimizer was prepared without its model; prepare the model too")

    def step(self, closure=None):
        if self.engine is None:
            raise TorchbayError("this optimizer was prepared without its model; prepare the model too")
        if closure is not None:
            raise TorchbayError("optimizer.step(closure) is not supported under DeepSpeed")

    def step_applied(self) -> bool:
        return self.engine is None or bool(self.engine.was_step_applied())

    def state_dict(self):
        return self.engine.optimizer.state_dict() if self.engine is not None else self.user_optimizer.state_dict()

    def load_state_dict(self, state):
        target = self.engine.optimizer if self.engine is not None else self.user_optimizer
        target.load_state_dict(state)

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.user_optimizer).__name__})"


class DeepSpeedSchedulerWrapper(PreparedScheduler):
    """What ``prepare`` returns for a scheduler DeepSpeed steps itself (a :class:`DummyScheduler`: the config's
    ``"scheduler"`` or its ``lr_scheduler_callable``), as Accelerate's class of this name: ``step`` does nothing
    (the engine steps it at the end of each accumulation window); the rest is DeepSpeed's scheduler.

    :param scheduler: DeepSpeed's scheduler (``engine.lr_scheduler``).
    :param optimizers: the prepared optimizer(s).
    :param engine: the engine, which answers ``get_last_lr`` when it has no scheduler object.
    """

    def __init__(self, scheduler: Any, optimizers: Any, accelerator: Any = None, engine: Any = None):
        super().__init__(scheduler, optimizers if isinstance(optimizers, list) else [optimizers], accelerator)
        self.engine = engine

    def step(self, *args, **kwargs):
        pass

    def get_last_lr(self):
        if self.scheduler is not None and hasattr(self.scheduler, "get_last_lr"):
            return self.scheduler.get_last_lr()
        return self.engine.get_lr()

    def state_dict(self):
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state):
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"DeepSpeedSchedulerWrapper({type(self.scheduler).__name__})"


class PendingEngine(torch.nn.Module):
    """A model prepared before its optimizer: runs the plain module until the optimizer is
    prepared, then the DeepSpeed engine built for both."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        object.__setattr__(self, "engine", None)

    def forward(self, *args, **kwargs):
        target = self.engine if self.engine is not None else self.module
        return target(*args, **kwargs)

    def train(self, mode: bool = True):
        (self.engine or self.module).train(mode)
        self.training = mode
        return self
