"""The built-in precisions: ``no``, ``fp16`` (autocast + loss scaling) and ``bf16`` (autocast)."""

from __future__ import annotations

import torch

from torchbay.axes.precision import Precision
from torchbay.config.handlers import AutocastKwargs, GradScalerKwargs
from torchbay.errors import CheckpointError
from torchbay.registry.manager import hookimpl


class AutocastPrecision(Precision):
    """torch.amp autocast around the model's forward, in ``dtype``."""

    dtype: torch.dtype = torch.bfloat16
    fp32_outputs = True

    @classmethod
    def check(cls, context) -> list[str]:
        backend = context.device_backend_cls
        if not backend.supports_autocast(cls.dtype):
            return [f"mixed_precision '{cls.name}' needs {cls.dtype} autocast, which device '{backend.name}' "
                    f"does not support; use mixed_precision: "
                    f"{'bf16' if cls.name == 'fp16' else 'fp16'} or no"]
        return []

    def __init__(self, context):
        super().__init__(context)
        handler = context.handler(AutocastKwargs) or AutocastKwargs()
        self.autocast_kwargs = handler

    @property
    def wraps_forward(self) -> bool:
        return True

    def forward_context(self, handler: AutocastKwargs | None = None):
        handler = handler or self.autocast_kwargs
        return self.device_backend.autocast(self.dtype, enabled=handler.enabled, cache_enabled=handler.cache_enabled)


class BF16Precision(AutocastPrecision):
    name = "bf16"
    dtype = torch.bfloat16


class FP16Precision(AutocastPrecision):
    """fp16 autocast with a dynamic loss scaler; steps with inf/nan gradients are skipped."""

    name = "fp16"
    dtype = torch.float16

    def __init__(self, context):
        super().__init__(context)
        handler = context.handler(GradScalerKwargs)
        self.scaler = context.strategy.grad_scaler(**(handler.to_kwargs() if handler else {}))

    def scale_loss(self, loss):
        return self.scaler.scale(loss)

    def unscale_gradients(self, optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, step, **kwargs) -> bool:
        before = self.scaler.get_scale()
        self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return self.scaler.get_scale() >= before

    def state_dict(self):
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state) -> None:
        if "scaler" not in state:

            raise CheckpointError("precision: the checkpoint has no fp16 loss-scaler state (was it saved with fp16?)")
        self.scaler.load_state_dict(state["scaler"])


@hookimpl
def torchbay_register_precisions():
    return [Precision, BF16Precision, FP16Precision]
