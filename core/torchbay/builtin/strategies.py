"""The built-in strategies: ``single`` (one process) and ``ddp`` (DistributedDataParallel)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from torchbay.kwargs import DistributedDataParallelKwargs
from torchbay.plugins import hookimpl
from torchbay.strategy import Strategy


class SingleStrategy(Strategy):
    """One process, one device."""

    name = "single"
    multi_process = False


class DDPStrategy(Strategy):
    """Replicate the model on every process; average gradients with DistributedDataParallel."""

    name = "ddp"

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device_backend.device)
        if self.world_size == 1 or not any(p.requires_grad for p in model.parameters()):
            return model
        handler = self.context.extras.get("kwargs_handlers", {}).get(DistributedDataParallelKwargs)
        kwargs = handler.to_kwargs() if handler else {}
        device_ids = self.device_backend.ddp_device_ids()
        if device_ids is not None:
            kwargs["device_ids"] = device_ids
        return DistributedDataParallel(model, **kwargs)

    def is_wrapped(self, model) -> bool:
        return isinstance(model, DistributedDataParallel)

    def no_sync(self, model):
        return model.no_sync() if self.is_wrapped(model) else super().no_sync(model)


@hookimpl
def torchbay_register_strategies():
    return [SingleStrategy, DDPStrategy]
