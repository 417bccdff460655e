"""The built-in strategies: ``single`` (one process) and ``ddp`` (DistributedDataParallel)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

from torchbay.axes.strategy import Strategy
from torchbay.config.handlers import DistributedDataParallelKwargs
from torchbay.registry.manager import hookimpl


class SingleStrategy(Strategy):
    """One process, one device."""

    name = "single"
    multi_process = False
    async_checkpoint = True


class DDPStrategy(Strategy):
    """Replicate the model on every process; average gradients with DistributedDataParallel."""

    name = "ddp"
    parallel_dims = ("dp_replicate",)  # parallelism.dp_replicate_size = the world size: plain DDP
    async_checkpoint = True  # the default save_checkpoint: no collective, rank 0 writes the full state

    def __init__(self, context):
        super().__init__(context)
        self._wrapped: list[weakref.ref] = []

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device_backend.device)
        if self.world_size == 1 or not any(p.requires_grad for p in model.parameters()):
            return model
        handler = self.context.handler(DistributedDataParallelKwargs)
        kwargs = handler.ddp_kwargs() if handler else {}
        device_ids = self.device_backend.ddp_device_ids()
        if device_ids is not None:
            kwargs["device_ids"] = device_ids
        wrapped = DistributedDataParallel(model, **kwargs)
        if handler is not None:
            handler.register_comm_hook(wrapped)
        self._wrapped.append(weakref.ref(wrapped))
        return wrapped

    def teardown(self, barrier: bool = True) -> None:
        """Destroy the group, and let go of it in every DDP wrapper.

        A wrapper's reducer keeps the C++ process group alive after ``destroy_process_group``;
        still alive at interpreter exit, gloo's threads can abort the process after a
        successful run. The wrappers cannot communicate once the group is gone anyway.
        """
        super().teardown(barrier)
        for ref in self._wrapped:
            wrapper = ref()
            if wrapper is not None:
                for attribute in ("reducer", "logger", "process_group"):
                    if hasattr(wrapper, attribute):
                        setattr(wrapper, attribute, None)
        self._wrapped.clear()
        gc.collect()  # what held the group in reference cycles goes now, not during interpreter shutdown

    def is_wrapped(self, model) -> bool:
        return isinstance(model, DistributedDataParallel)

    def no_sync(self, model):
        return model.no_sync() if self.is_wrapped(model) else super().no_sync(model)

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model):
        """The next backward reduces gradients even inside ``no_sync`` (DDP's reducer is re-armed)."""
        if not self.is_wrapped(model):
            yield
            return
        old = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = old

    joins_uneven_inputs = True

    def join_context(self, models):
        """torch's ``Join`` over the wrapped models: ranks out of batches shadow the others' collectives."""
        from torch.distributed.algorithms.join import Join

        return Join(list(models))


@hookimpl
def torchbay_register_strategies():
    return [SingleStrategy, DDPStrategy]
