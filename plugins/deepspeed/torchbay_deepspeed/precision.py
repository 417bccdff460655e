"""The precision a DeepSpeed run uses: DeepSpeed's engine does mixed precision and loss scaling itself, so torchbay's
precision only says which mode the engine's config gets."""

from __future__ import annotations

from torchbay.plugin import Precision
from torchbay_deepspeed.objects import (
    EngineOptimizer,
)


class DeepSpeedPrecision(Precision):
    """Takes the place of the selected plain precision (no/fp16/bf16): DeepSpeed does that
    mode itself (module conversion, loss scaler, from the ``bf16``/``fp16`` sections torchbay
    writes into its config), so no autocast or scaler runs here. An engine precision (fp8) is
    refused by :meth:`DeepSpeedStrategy.check` before it gets here."""

    def __init__(self, context, replaced: Precision):
        super().__init__(context)
        self.replaced = replaced
        self.name = replaced.name  # type: ignore[misc]

    def optimizer_step(self, optimizer, step, **kwargs) -> bool:
        step(optimizer, **kwargs)
        return optimizer.step_applied() if isinstance(optimizer, EngineOptimizer) else True

    def describe(self) -> str:
        return f"deepspeed {self.name}"
