"""``mixed_precision: fp8`` with ``fp8.backend: msamp`` (Microsoft MS-AMP).

``msamp.initialize(model, optimizer, opt_level)`` converts every ``nn.Linear`` to MS-AMP's
FP8 Linear and replaces the optimizer with its low-bit one (O1: FP8 weights and weight
gradients, O2: also FP8/FP16 optimizer states). It needs the model and its optimizer
together, so pass both to one ``accelerator.prepare(model, optimizer)`` call; the forward
runs under bf16 autocast (``fp8.outer_autocast``).

MS-AMP supports neither DeepSpeed ZeRO-3 nor FSDP through this plugin: such a set-up fails
before any process starts. MS-AMP converts every Linear and chooses its own scaling, so the
``fp8`` settings it cannot honour (a recipe other than tensorwise, include/exclude, a
margin, amax history) are errors when set.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from torchbay.errors import TorchbayError

from torchbay import fp8 as fp8_support
from torchbay_fp8_msamp._zero import zero_stage

log = logging.getLogger("torchbay.fp8")

ENGINE = "msamp"
OPT_LEVELS = {"O1", "O2"}
OPTIONS: dict[str, Any] = {"opt_level": OPT_LEVELS, "use_te": bool, "small_layer_threshold": (int, float)}


def strategy_problems(config) -> list[str]:
    """What MS-AMP cannot run: ZeRO-3 and FSDP (read defensively from the config tree)."""
    problems = []
    stage = zero_stage(config)
    if stage is not None and stage >= 3:
        problems.append("fp8 engine 'msamp' does not support DeepSpeed ZeRO-3 (MS-AMP cannot shard its FP8 "
                        "parameters across ranks): set the deepspeed ZeRO stage to 0, 1 or 2, or use "
                        "fp8.backend: te or torchao")
    if getattr(config, "strategy", None) == "fsdp":
        problems.append("fp8 engine 'msamp' does not run under strategy: fsdp in torchbay; use strategy: ddp or "
                        "deepspeed (ZeRO 0-2), or fp8.backend: torchao with FSDP2")
    return problems


class MSAMPFP8Precision(fp8_support.FP8Precision):
    name = "fp8"
    fp8_backend = ENGINE
    priority = 10  # MS-AMP is no longer developed: auto prefers te and torchao
    engine_module = "msamp"
    install_hint = ("MS-AMP is not on PyPI; install it from source (git clone --recursive "
                    "https://github.com/Azure/MS-AMP; cd MS-AMP; pip install -e .; make postinstall), "
                    "then pip install torchbay-fp8-msamp")

    @classmethod
    def unavailable_reason(cls, device_backend_cls, config=None) -> str | None:
        reason = super().unavailable_reason(device_backend_cls, config)
        if reason:
            return reason
        if device_backend_cls.torch_type() != "cuda" or getattr(torch.version, "hip", None):
            return (f"MS-AMP runs on NVIDIA GPUs only, not on device '{device_backend_cls.name}'; use "
                    f"fp8.backend: torchao (with fp8.engine_options.emulate: true off-GPU) or mixed_precision: bf16")
        return None

    @classmethod
    def check(cls, context) -> list[str]:
        fp8 = context.config.fp8
        explicit = lambda key: fp8_support.is_explicit(context, key)  # noqa: E731
        problems = fp8_support.option_problems(ENGINE, dict(fp8.engine_options), OPTIONS)
        why = "MS-AMP converts every nn.Linear and scales each tensor itself"
        if fp8.recipe != "tensorwise":
            problems.append(fp8_support.unsupported_setting(ENGINE, "recipe", fp8.recipe,
                                                        "MS-AMP scales per tensor only (tensorwise); use fp8.backend: te"))
        for key in ("include", "exclude"):
            if getattr(fp8, key):
                problems.append(fp8_support.unsupported_setting(ENGINE, key, getattr(fp8, key), why))
        if explicit("keep_first_and_last") and fp8.keep_first_and_last:
            problems.append(fp8_support.unsupported_setting(ENGINE, "keep_first_and_last", True, why))
        for key in ("format", "margin", "amax_history_len", "amax_compute_algo"):
            if explicit(key):
                problems.append(fp8_support.unsupported_setting(ENGINE, key, getattr(fp8, key), why + "; remove it"))
        device = context.device_backend_cls
        if fp8.outer_autocast and not device.supports_autocast(torch.bfloat16):
            problems.append(f"fp8.outer_autocast needs bf16 autocast, which device '{device.name}' lacks")
        return problems

    def __init__(self, context):
        super().__init__(context)
        self.fp8 = context.config.fp8
        self.options = dict(self.fp8.engine_options)
        self.opt_level = self.options.get("opt_level", "O1")
        self.initialized = False

    def initialize(self, objects: list[Any]) -> list[Any] | None:
        """Run ``msamp.initialize`` on the model and optimizer of one ``prepare`` call."""
        models = [i for i, o in enumerate(objects) if isinstance(o, torch.nn.Module)]
        optimizers = [i for i, o in enumerate(objects) if isinstance(o, torch.optim.Optimizer)]
        if not models and not optimizers:
            return None
        if self.initialized or len(models) != 1 or len(optimizers) != 1:
            raise TorchbayError(
                "fp8 engine 'msamp' initialises one model together with its optimizer (msamp.initialize): pass "
                "exactly one model and one optimizer to a single accelerator.prepare(model, optimizer, ...) call"
                + (" (it was already done once in this run)" if self.initialized else
                   f" (this call had {len(models)} model(s) and {len(optimizers)} optimizer(s))"))
        import msamp

        model, optimizer = objects[models[0]], objects[optimizers[0]]
        shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
                  if type(m) is torch.nn.Linear}
        kwargs: dict[str, Any] = {"opt_level": self.opt_level}
        if "use_te" in self.options and "use_te" in inspect.signature(msamp.initialize).parameters:
            kwargs["use_te"] = self.options["use_te"]
        model, optimizer = msamp.initialize(model, optimizer, **kwargs)
        self.initialized = True
        main = fp8_support.is_main_process(self.context)
        if main:
            log.info("fp8 (msamp %s): %d Linear module(s) converted to FP8: %s", self.opt_level, len(shapes),
                     ", ".join(f"{n} ({k}->{o})" for n, (k, o) in shapes.items()) or "none")
        fp8_support.warn_small_layers(ENGINE, shapes, self.options, main)
        out = list(objects)
        out[models[0]], out[optimizers[0]] = model, optimizer
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"engine": ENGINE, "opt_level": self.opt_level}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torchbay.errors import CheckpointError

        if state.get("engine") != ENGINE or state.get("opt_level") != self.opt_level:
            raise CheckpointError(f"precision: the checkpoint was saved with {state}, this run uses msamp "
                                  f"{self.opt_level}; resume with the same fp8 engine and opt_level")

    def describe(self) -> str:
        return f"fp8:msamp:{self.opt_level}"
