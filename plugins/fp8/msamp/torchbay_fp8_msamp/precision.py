"""``mixed_precision: fp8`` with ``fp8.backend: msamp`` (Microsoft MS-AMP).

``msamp.initialize(model, optimizer, opt_level)`` converts every ``nn.Linear`` to MS-AMP's
FP8 Linear and replaces the optimizer with its low-bit one (O1: FP8 weights and weight
gradients, O2: also FP8/FP16 optimizer states). It needs the model and its optimizer
together, so pass both to one ``accelerator.prepare(model, optimizer)`` call: it runs in
:meth:`MSAMPFP8Precision.prepare`, before the strategy wraps them. The forward runs under
bf16 autocast (``fp8.outer_autocast``).

MS-AMP runs neither under DeepSpeed nor under FSDP through this plugin: such a set-up fails
before any process starts (:meth:`MSAMPFP8Precision.check`). MS-AMP converts every Linear
and chooses its own scaling, so the ``fp8`` settings it cannot honour (a recipe other than
tensorwise, include/exclude, a margin, amax history) are errors when set.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torchbay_fp8 import FP8Precision, warn_small_layers
from torchbay_fp8.precision import is_explicit, name_handler_sources

from torchbay.errors import CheckpointError, TorchbayError

log = logging.getLogger("torchbay.fp8")

ENGINE = "msamp"
OPT_LEVELS = {"O1", "O2"}
OPTIONS: dict[str, Any] = {**FP8Precision.accepted_options, "opt_level": OPT_LEVELS, "use_te": bool}


#: strategies MS-AMP cannot run under, and why (it replaces model and optimizer before the strategy wraps them)
REFUSED_STRATEGIES = {
    "deepspeed": "MS-AMP cannot shard its FP8 parameters (ZeRO-3), and torchbay-deepspeed takes no mixed_precision fp8 "
                 "at any ZeRO stage (DeepSpeed's own MS-AMP integration is not offered)",
    "fsdp": "FSDP cannot shard MS-AMP's FP8 parameters and optimizer",
}


def strategy_problems(config) -> list[str]:
    """MS-AMP under a strategy it cannot run under (deepspeed, fsdp): the problem and the fix."""
    strategy = getattr(config, "strategy", None)
    if strategy not in REFUSED_STRATEGIES:
        return []
    return [f"fp8 engine 'msamp' does not run under strategy: {strategy}: {REFUSED_STRATEGIES[strategy]}; use "
            f"strategy: ddp, or fp8.backend: te or torchao (torchao also under FSDP2)"]


class MSAMPFP8Precision(FP8Precision):
    """MS-AMP: ``msamp.initialize`` on the model and optimizer of one ``prepare`` call."""

    engine = ENGINE
    priority = 10  # MS-AMP is no longer developed: auto prefers te and torchao
    engine_module = "msamp"
    install_hint = ("MS-AMP is not on PyPI; install it from source (git clone --recursive "
                    "https://github.com/Azure/MS-AMP; cd MS-AMP; pip install -e .; make postinstall), "
                    "then pip install torchbay-fp8-msamp")
    accepted_options = OPTIONS

    @classmethod
    def unavailable_reason(cls, device_backend_cls, config=None) -> str | None:
        reason = super().unavailable_reason(device_backend_cls, config)
        if reason:
            return reason
        if device_backend_cls.torch_type() != "cuda" or getattr(torch.version, "hip", None):
            return (f"MS-AMP runs on NVIDIA GPUs only, not on device '{device_backend_cls.name}'; use "
                    f"fp8.backend: torchao (with fp8.emulate: true off-GPU) or mixed_precision: bf16")
        return None

    @classmethod
    def check(cls, context) -> list[str]:
        """The fp8 settings MS-AMP cannot honour, and the strategies it cannot run under."""
        fp8 = context.config.fp8
        problems = super().check(context)
        why = "MS-AMP converts every nn.Linear and scales each tensor itself"
        if fp8.recipe != "tensorwise":
            problems.append(cls.unsupported("recipe", fp8.recipe,
                                            "MS-AMP scales per tensor only (tensorwise); use fp8.backend: te"))
        for key in ("include", "exclude"):
            if getattr(fp8, key):
                problems.append(cls.unsupported(key, getattr(fp8, key), why))
        if is_explicit(context, "keep_first_and_last") and fp8.keep_first_and_last:
            problems.append(cls.unsupported("keep_first_and_last", True, why))
        for key in ("format", "margin", "amax_history_len", "amax_compute_algo"):
            if is_explicit(context, key):
                problems.append(cls.unsupported(key, getattr(fp8, key), why + "; remove it"))
        return name_handler_sources(context, problems + strategy_problems(context.config))

    def __init__(self, context):
        super().__init__(context)
        self.opt_level = self.options.get("opt_level", "O1")
        self.initialized = False

    def prepare(self, models: list, optimizers: list) -> tuple[list, list]:
        """Run ``msamp.initialize`` on the model and optimizer of one ``prepare`` call."""
        if not models and not optimizers:
            return models, optimizers
        if self.initialized or len(models) != 1 or len(optimizers) != 1:
            raise TorchbayError(
                "fp8 engine 'msamp' initialises one model together with its optimizer (msamp.initialize): pass "
                "exactly one model and one optimizer to a single accelerator.prepare(model, optimizer, ...) call"
                + (" (it was already done once in this run)" if self.initialized else
                   f" (this call had {len(models)} model(s) and {len(optimizers)} optimizer(s))"))
        import msamp

        model, optimizer = models[0], optimizers[0]
        shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
                  if type(m) is torch.nn.Linear}
        kwargs: dict[str, Any] = {"opt_level": self.opt_level}
        if "use_te" in self.options and "use_te" in inspect.signature(msamp.initialize).parameters:
            kwargs["use_te"] = self.options["use_te"]
        model, optimizer = msamp.initialize(model, optimizer, **kwargs)
        self.initialized = True
        main = self.is_main_process
        if main:
            log.info("fp8 (msamp %s): %d Linear module(s) converted to FP8: %s", self.opt_level, len(shapes),
                     ", ".join(f"{n} ({k}->{o})" for n, (k, o) in shapes.items()) or "none")
        warn_small_layers(ENGINE, shapes, self.options, main)
        return [model], [optimizer]

    def state_dict(self) -> dict[str, Any]:
        # MS-AMP keeps weights and optimizer state in its own types: no other precision can resume it
        return {"engine": ENGINE, "opt_level": self.opt_level, "portable": False, "describe": self.describe()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_saved_engine(state)
        if state.get("opt_level") != self.opt_level:
            raise CheckpointError(f"precision: the checkpoint was saved with msamp {state.get('opt_level')}, this "
                                  f"run uses msamp {self.opt_level}; resume with the same "
                                  f"fp8.engine_options.opt_level")

    def describe(self) -> str:
        return f"fp8:msamp:{self.opt_level}"
