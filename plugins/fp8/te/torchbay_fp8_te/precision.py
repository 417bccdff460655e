"""``mixed_precision: fp8`` with ``fp8.backend: te`` (NVIDIA Transformer Engine).

- ``prepare`` converts eligible ``nn.Linear`` (and ``nn.LayerNorm``) to TE modules before the
  strategy wraps the model, or uses a model that already has TE modules as it is.
- The converted TE modules take over the *same* ``nn.Parameter`` objects, so an optimizer
  built on the original model keeps working: model and optimizer may be prepared in one
  call or in separate calls, in either order.
- The forward runs under TE's FP8 autocast with the recipe of the ``fp8`` section (see
  :mod:`torchbay_fp8_te.recipes`), inside a bf16 autocast when ``fp8.outer_autocast``.
- Every TE module's FP8 scaling state (amax history, scales) is saved per rank by
  ``save_state`` and restored exactly by ``load_state`` (per-rank precision state).
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

import torch
from torchbay_fp8 import FP8Precision, plan_linears, warn_small_layers
from torchbay_fp8.precision import is_explicit, name_handler_sources

from torchbay.errors import CheckpointError
from torchbay_fp8_te import recipes

log = logging.getLogger("torchbay.fp8")

ENGINE = "te"

OPTIONS: dict[str, Any] = {
    **FP8Precision.accepted_options,
    "convert_layernorm": bool,     # nn.LayerNorm -> te.LayerNorm (default true)
    "recipe_kwargs": dict,         # extra keyword arguments of the TE recipe class
    "amax_reduction": bool,        # reduce amaxes over the data-parallel group (default true)
}


def _is_te_module(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("transformer_engine")


class TransformerEngineFP8Precision(FP8Precision):
    """Transformer Engine modules in place of eligible Linear/LayerNorm, TE's FP8 autocast around
    the forward (inside the base's bf16 autocast), FP8 scaling state saved per rank."""

    engine = ENGINE
    priority = 100
    accepted_options = OPTIONS
    engine_module = "transformer_engine"
    install_hint = ("pip install 'torchbay-fp8-te[engine]' (installs transformer-engine[pytorch]; it builds "
                    "against your CUDA toolkit)")

    # -- validation ---------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device_backend_cls, config=None) -> str | None:
        reason = super().unavailable_reason(device_backend_cls, config)
        if reason:
            return reason
        device_type = device_backend_cls.torch_type()
        if device_type != "cuda":
            return (f"Transformer Engine runs on NVIDIA GPUs (compute capability 8.9+), not on device "
                    f"'{device_backend_cls.name}'; for FP8 numerics there use fp8.backend: torchao with "
                    f"fp8.emulate: true, or mixed_precision: bf16")
        if getattr(torch.version, "hip", None):
            return None  # ROCm's Transformer Engine decides in check()
        cap = device_backend_cls.compute_capability()
        if cap is None:
            return "no NVIDIA GPU was found"
        if cap < (8, 9):
            return (f"the GPU has compute capability {cap[0]}.{cap[1]}; Transformer Engine's FP8 needs 8.9+ "
                    f"(Ada, Hopper, Blackwell); use mixed_precision: bf16")
        return None

    @classmethod
    def check(cls, context) -> list[str]:
        fp8 = context.config.fp8
        problems = super().check(context)
        explicit = lambda key: is_explicit(context, key)  # noqa: E731
        problems += recipes.recipe_problems(fp8, explicit, cls.name)
        device = context.device_backend_cls
        if not problems and device.torch_type() == "cuda" and cls.unavailable_reason(device) is None:
            problems += cls._hardware_problems(recipes.recipe_of(fp8, explicit, cls.name))
        return name_handler_sources(context, problems)

    @staticmethod
    def _hardware_problems(recipe: str) -> list[str]:
        try:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager as manager
        except Exception as exc:  # a broken TE install is reported, not raised
            return [f"fp8 engine 'te': importing transformer_engine failed: {type(exc).__name__}: {exc}"]
        probes = [("is_fp8_available", "FP8")]
        if recipe == "mxfp8":
            probes.append(("is_mxfp8_available", "MXFP8 block scaling (fp8.recipe: mxfp8)"))
        if recipe == "nvfp4":
            probes.append(("is_nvfp4_available", "NVFP4 block scaling (fp8.recipe: nvfp4, Blackwell)"))
        if recipe == "block":
            probes.append(("is_fp8_block_scaling_available", "FP8 block scaling (fp8.recipe: block)"))
        problems = []
        for probe, what in probes:
            fn = getattr(manager, probe, None)
            if fn is None:
                problems.append(f"fp8 engine 'te': this Transformer Engine has no {what}; upgrade it")
                continue
            ok, reason = fn()
            if not ok:
                problems.append(f"fp8 engine 'te' cannot use {what} here: {reason}")
        return problems

    # -- set-up -------------------------------------------------------------------------
    def __init__(self, context):
        super().__init__(context)
        self.recipe_spec = recipes.recipe_spec(self.fp8, self.is_explicit, self.name)
        self._recipe = None
        #: per prepared model: names of the modules converted to TE (or found already TE)
        self.converted: list[list[str]] = []
        self._te_modules: dict[str, torch.nn.Module] = {}
        self._models: list[torch.nn.Module] = []
        self.plans: list = []

    @property
    def recipe(self):
        if self._recipe is None:
            self._recipe = recipes.build_recipe(self.fp8, self.is_explicit, self.name)
        return self._recipe

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if any(m is module for m in self._models):
            return module
        import transformer_engine.pytorch as te

        index = len(self._models)
        main = self.is_main_process
        existing = [name for name, m in module.named_modules() if _is_te_module(m)]
        if existing:
            converted = []
            if main:
                log.info("fp8 (te): the model already has %d Transformer Engine module(s); using it as it is",
                         len(existing))
        else:
            recipe = recipes.recipe_of(self.fp8, self.is_explicit, self.name)
            plan = plan_linears(module, self.fp8, small_below=self.small_layer_filter(), recipe=recipe,
                                shape_multiple=32 if recipe in ("mxfp8", "nvfp4") else 16)
            self.plans.append(plan)
            device = self.device_backend.device if self.device_backend.torch_type() == "cuda" else "cuda"
            for name in plan.convert:
                module = _replace(module, name, _te_linear(te, module.get_submodule(name), device))
            converted = list(plan.convert)
            if self.options.get("convert_layernorm", True):
                for name, norm in list(module.named_modules()):
                    if _convertible_layernorm(norm, self.fp8, name):
                        module = _replace(module, name, _te_layernorm(te, norm, device))
                        converted.append(name)
            self.log_plan(plan, f"{self.name} (te, {self.recipe_spec[0]}):")
            warn_small_layers(ENGINE, {n: plan.shapes[n] for n in plan.convert}, self.options, main)
        self.converted.append(converted)
        self._models.append(module)
        for name, m in module.named_modules():
            if _is_te_module(m) and hasattr(m, "get_extra_state"):
                self._te_modules[f"{index}:{name}"] = m
        return module

    # -- every step ---------------------------------------------------------------------
    @property
    def wraps_forward(self) -> bool:
        return True  # TE's FP8 autocast, with or without the outer bf16 one

    def forward_context(self, handler=None):
        import transformer_engine.pytorch as te

        stack = contextlib.ExitStack()
        stack.enter_context(super().forward_context(handler))  # bf16 autocast with fp8.outer_autocast
        group = None
        if self.options.get("amax_reduction", True) and torch.distributed.is_available() \
                and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            group = torch.distributed.group.WORLD
        if hasattr(te, "fp8_autocast"):
            stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=group))
        else:  # Transformer Engine 2.8+ renamed it
            stack.enter_context(te.autocast(enabled=True, recipe=self.recipe, amax_reduction_group=group))
        return stack

    # -- state ----------------------------------------------------------------------------
    def scaling_state(self) -> dict[str, Any]:
        """Every TE module's FP8 state (amax history, scales) as tensors (weights_only-loadable)."""
        modules: dict[str, torch.Tensor] = {}
        kinds: dict[str, str] = {}
        for key, module in self._te_modules.items():
            extra = module.get_extra_state()
            if extra is None:
                modules[key], kinds[key] = torch.empty(0, dtype=torch.uint8), "none"
            elif isinstance(extra, io.BytesIO):
                modules[key], kinds[key] = torch.frombuffer(bytearray(extra.getvalue()), dtype=torch.uint8), "bytes"
            elif isinstance(extra, torch.Tensor):
                modules[key], kinds[key] = extra.detach().cpu().clone(), "tensor"
            else:
                raise CheckpointError(f"fp8 (te): module {key} returned FP8 state of type {type(extra).__name__}, "
                                      f"which torchbay cannot save safely")
        return {"recipe": self.recipe_spec[0], "modules": modules, "kinds": kinds}

    def load_scaling_state(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise CheckpointError("fp8 (te): the checkpoint holds no Transformer Engine FP8 scaling state for this "
                                  "rank (precision_rank_<r>.pt); was it saved with fp8.backend: te?")
        if state.get("recipe") != self.recipe_spec[0]:
            raise CheckpointError(f"fp8 (te): the checkpoint's FP8 state is for recipe {state.get('recipe')!r}, this "
                                  f"run uses {self.recipe_spec[0]!r}; resume with the same fp8.recipe")
        saved = set(state.get("modules", {}))
        if saved != set(self._te_modules):
            raise CheckpointError(f"fp8 (te): the checkpoint has FP8 state for modules {sorted(saved)}, this run's TE "
                                  f"modules are {sorted(self._te_modules)}; prepare the same model with the same "
                                  f"fp8.include / fp8.exclude")
        for key, module in self._te_modules.items():
            kind, value = state["kinds"][key], state["modules"][key]
            if kind == "none":
                continue
            payload = io.BytesIO(value.numpy().tobytes()) if kind == "bytes" else value
            try:
                module.set_extra_state(payload)
            except Exception as exc:
                raise CheckpointError(f"fp8 (te): FP8 state of module {key} could not be restored: "
                                      f"{type(exc).__name__}: {exc}") from exc

    # each rank's amax history and scales differ: saved per rank
    rank_state_dict = scaling_state
    load_rank_state_dict = load_scaling_state

    def state_dict(self) -> dict[str, Any]:
        name, kwargs = self.recipe_spec
        return {"engine": ENGINE, "mode": self.name, "recipe": name, "describe": self.describe(),
                "recipe_kwargs": {k: str(v) for k, v in kwargs.items()},
                "converted": [list(c) for c in self.converted], "layers": [plan.recipes for plan in self.plans]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.saved_here(state):
            return
        if state.get("converted") != self.converted:
            raise CheckpointError(f"precision: the checkpoint converted other modules to TE ({state.get('converted')}) "
                                  f"than this run ({self.converted})")

    def describe(self) -> str:
        return f"{self.name}:te:{self.recipe_spec[0]}"


class TransformerEngineFP4Precision(TransformerEngineFP8Precision):
    """``mixed_precision: fp4`` on Transformer Engine: its NVFP4 recipe (Blackwell), configured by ``fp8``."""

    name = "fp4"


# --- conversion helpers ------------------------------------------------------------------


def _replace(root: torch.nn.Module, name: str, new: torch.nn.Module) -> torch.nn.Module:
    if name == "":
        return new
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
    return root


def _te_linear(te, linear: torch.nn.Linear, device) -> torch.nn.Module:
    """A ``te.Linear`` that owns ``linear``'s own Parameter objects (optimizers keep working)."""
    new = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    params_dtype=linear.weight.dtype, device=device)
    new.weight = linear.weight
    if linear.bias is not None:
        new.bias = linear.bias
    new.train(linear.training)
    return new


def _convertible_layernorm(module: torch.nn.Module, fp8, name: str) -> bool:
    import re

    return (type(module) is torch.nn.LayerNorm and len(module.normalized_shape) == 1
            and module.elementwise_affine and module.bias is not None
            and not any(re.search(p, name) for p in fp8.exclude))


def _te_layernorm(te, norm: torch.nn.LayerNorm, device) -> torch.nn.Module:
    new = te.LayerNorm(norm.normalized_shape[0], eps=norm.eps, params_dtype=norm.weight.dtype, device=device)
    new.weight = norm.weight
    new.bias = norm.bias
    new.train(norm.training)
    return new
