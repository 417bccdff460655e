"""The precision axis: autocast, loss scaling and module conversion.

:class:`Precision` does nothing (full precision); subclasses override what they change.
Built-in: ``no``, ``fp16`` and ``bf16`` (torch.amp). Other modes exist only because a
plugin registers a class for them. The registry is keyed by ``(mode, engine)``: a plain mode
has one class (``engine = None``); a mode several engines serve has one class per engine,
and the user picks one with ``<mode>.backend`` (``auto``: the available engine of highest
``priority``) in the config section of that name, which the mode's plugin contributes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from torchbay.errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.context import RunContext


class Precision:
    """Full precision: no conversion, no autocast, no loss scaling."""

    #: the ``mixed_precision`` value (mode) this class serves
    name: ClassVar[str] = "no"
    #: for a mode several engines serve: the ``<mode>.backend`` value this class serves
    engine: ClassVar[str | None] = None
    #: order among a mode's engines for ``<mode>.backend: auto`` (higher first)
    priority: ClassVar[int] = 0
    #: import name of the engine library (checked cheaply with find_spec), or None
    engine_module: ClassVar[str | None] = None
    #: what to install when ``engine_module`` is missing (shown in the error)
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

    def compile_reason(self, module: torch.nn.Module) -> str | None:
        """Why ``module`` (converted by this precision) needs ``torch.compile`` to be fast, so that
        ``compile.enabled: auto`` compiles it; ``None`` (here): it does not."""
        return None

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
        """Nothing to restore; state an engine saved (another precision's) is dropped with a one-line notice."""
        if state and state.get("portable") is False:
            was = state.get("describe") or state["engine"]
            raise CheckpointError(f"precision: the checkpoint was saved with {was}, which keeps weights and optimizer "
                                  f"state in its own format; this run ({self.describe()}) cannot resume it: resume "
                                  f"with the precision it was saved with")
        if state and state.get("engine"):
            logging.getLogger("torchbay").warning(
                "precision: the checkpoint was saved with %s; this run uses %s: the weights load, the engine's "
                "state (%s) is dropped", state.get("describe") or f"engine {state['engine']!r}", self.describe(),
                ", ".join(sorted(k for k in state if k not in ("engine", "describe"))) or "none")

    def rank_state_dict(self) -> dict[str, Any] | None:
        """State that differs between ranks (e.g. FP8 scaling history), saved by every rank; ``None``: none."""
        return None

    def load_rank_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`rank_state_dict`; ``state`` is ``None`` when the checkpoint holds none for this rank."""

    def describe(self) -> str:
        return self.name


# --- the registry: (mode, engine) -> class ----------------------------------------------

#: modes no built-in serves -> the distribution(s) that register them, for the error when
#: none is installed (data only: the core imports none of them)
MODE_DISTRIBUTIONS = {"fp8": "an FP8 engine plugin: pip install torchbay-fp8-<engine> (engines: docs/precision.md)",
                      "fp4": "an FP4 engine plugin: pip install torchbay-fp8-<engine> (docs/precision.md)"}
#: modes configured by another mode's section: ``mixed_precision: fp4`` reads the ``fp8`` section
SHARED_SECTIONS = {"fp4": "fp8"}


def registry_key(cls: type) -> str:
    """The registry key of a precision class: ``mode``, or ``mode:engine`` for an engine."""
    engine = getattr(cls, "engine", None)
    return f"{cls.name}:{engine}" if engine else cls.name


def by_mode(registry: dict[str, type]) -> dict[str, dict[str | None, type]]:
    """``{mode: {engine: class}}`` from the registry (a plain mode's engine is ``None``)."""
    modes: dict[str, dict[str | None, type]] = {}
    for cls in registry.values():
        modes.setdefault(cls.name, {})[getattr(cls, "engine", None)] = cls
    return modes


def engine_setting(config: Any, mode: str) -> str:
    """The ``<mode>.backend`` value (``auto`` when the mode's section or key is absent)."""
    return getattr(getattr(config, SHARED_SECTIONS.get(mode, mode), None), "backend", "auto")


def mode_install_hint(mode: str) -> str:
    """What to install so that ``mixed_precision: <mode>`` has an implementation."""
    return MODE_DISTRIBUTIONS.get(mode, "a plugin that registers it (check the spelling: no plugin torchbay "
                                        "publishes registers it)")
