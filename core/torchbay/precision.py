"""The precision axis: autocast, loss scaling and module conversion.

:class:`Precision` does nothing (full precision); subclasses override what they change.
Built-in: ``no``, ``fp16`` and ``bf16`` (torch.amp). FP8 engines are separate
distributions that register a class with ``name = "fp8"`` and their ``fp8_backend``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.context import RunContext


class Precision:
    """Full precision: no conversion, no autocast, no loss scaling."""

    name: ClassVar[str] = "no"
    #: for ``name == "fp8"``: the ``fp8.backend`` value this engine serves
    fp8_backend: ClassVar[str | None] = None
    #: order among FP8 engines for ``fp8.backend: auto`` (higher first)
    priority: ClassVar[int] = 0
    #: import name of the engine library (checked cheaply with find_spec), or None
    engine_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""

    def __init__(self, context: RunContext):
        self.context = context
        self.device_backend = context.device_backend

    @classmethod
    def check(cls, context: RunContext) -> list[str]:
        """Problems with this precision in ``context`` (device support, engine installed)."""
        return []

    @classmethod
    def unavailable_reason(cls, device_backend_cls: Any, config: Any = None) -> str | None:
        """Why this precision cannot run on that device class here (with ``config``), or ``None``."""
        if cls.engine_module:
            import importlib.util

            if importlib.util.find_spec(cls.engine_module.split(".")[0]) is None:
                return f"its engine '{cls.engine_module}' is not installed" + (
                    f": {cls.install_hint}" if cls.install_hint else "")
        return None

    # -- preparing ------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Change the model before the strategy wraps it (e.g. swap Linear for FP8 Linear)."""
        return module

    def forward_context(self):
        """Context wrapped around the model's forward (autocast); ``nullcontext`` here."""
        return contextlib.nullcontext()

    @property
    def wraps_forward(self) -> bool:
        """Whether ``prepare`` should wrap the model's forward in :meth:`forward_context`."""
        return False

    #: whether the wrapped forward casts half-precision outputs back to fp32 (Accelerate's
    #: ``convert_outputs_to_fp32``), so that what the user computes from them runs in fp32
    fp32_outputs: ClassVar[bool] = False

    def prepare(self, models: list, optimizers: list) -> tuple[list, list]:
        """Hand models and optimizers to an engine that must see both (after :meth:`convert_module`,
        before the strategy wraps them); return them, possibly replaced, same lengths and order."""
        return models, optimizers

    # -- every step ---------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_gradients(self, optimizer: Any) -> None:
        """Make gradients true values before clipping; nothing to do without a scaler."""

    def optimizer_step(self, optimizer: Any, step, **kwargs) -> bool:
        """Run ``step(optimizer, **kwargs)``; return False when the step was skipped."""
        step(optimizer, **kwargs)
        return True

    def after_optimizer_step(self, optimizer: Any) -> None:
        """Called after every real optimizer step (e.g. to refresh FP8 weight scales)."""

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float, strategy) -> Any:
        """Clip gradients; an engine with its own gradient type overrides this."""
        return strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """State shared by every rank (saved once, by the main process)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def rank_state_dict(self) -> dict[str, Any] | None:
        """State that differs between ranks (e.g. FP8 scaling history), saved by every rank; ``None``: none."""
        return None

    def load_rank_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`rank_state_dict`; ``state`` is ``None`` when the checkpoint holds none for this rank."""

    def describe(self) -> str:
        return self.name
