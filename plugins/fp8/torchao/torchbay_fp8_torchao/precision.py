"""``mixed_precision: fp8`` (and ``fp4``) with ``fp8.backend: torchao``.

Recipes (``fp8.recipe``): ``tensorwise`` (= ``current``) and ``rowwise`` through torchao's Float8 Linear;
``mxfp8`` and, with ``mixed_precision: fp4``, ``mxfp4`` through MX block-scaled Linears (:mod:`.mx`).
``nvfp4`` is refused: torchao's NVFP4 tensors serve inference, it has no NVFP4 training path (use
``fp8.backend: te`` on Blackwell).

torchao's ``convert_to_float8_training`` swaps eligible ``nn.Linear`` for its Float8 Linear
(dynamic scaling: the scale of each tensor is computed from the tensor itself, so there is
no scaling history to checkpoint). The conversion runs in ``prepare`` before the strategy
wraps the model, so DDP and FSDP2 see the FP8 modules. Under FSDP2 (tensorwise recipe) the
weights are all-gathered in FP8 and their scales are precomputed after each optimizer step.

Emulation: on a device without FP8 tensor cores (the CPU; NVIDIA GPUs below compute
capability 8.9), torchao can emulate FP8 (or MX) numerics in high precision. That is opt-in with
``fp8.emulate: true`` (or ``fp8.engine_options.emulate``; slower than bf16, for tests and numerics studies);
without it such a set-up fails before training, naming the fix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchbay_fp8 import FP8Precision, LinearPlan, plan_linears, warn_small_layers
from torchbay_fp8.handlers import AORecipeKwargs
from torchbay_fp8.precision import is_explicit, name_handler_sources

from torchbay_fp8_torchao.mx import MX_RECIPES, convert_mx, native_reason

log = logging.getLogger("torchbay.fp8")

ENGINE = "torchao"

#: fp8.recipe -> torchao recipe name (``current`` is dynamic per-tensor scaling, i.e. tensorwise)
RECIPES = {"tensorwise": "tensorwise", "current": "tensorwise", "rowwise": "rowwise"}
FP4_RECIPES = ("mxfp4", "nvfp4")
NVFP4_REFUSED = ("torchao has no NVFP4 training path (its NVFP4 tensors serve inference, and nothing of it trains on "
                 "this CPU); use fp8.recipe: mxfp4, or fp8.backend: te (Transformer Engine's NVFP4 recipe, Blackwell)")


def recipe_of(mode: str, fp8, explicit: bool = True) -> str:
    """The recipe a run of ``mode`` uses: ``fp8.recipe``, or under fp4 when it was not set, ``mxfp4``."""
    if mode == "fp4" and not (explicit and fp8.recipe in FP4_RECIPES):
        return fp8.recipe if explicit and fp8.recipe != "tensorwise" else "mxfp4"
    return fp8.recipe

OPTIONS: dict[str, Any] = {
    **FP8Precision.accepted_options,
    "emulate": bool,                        # emulate FP8 numerics (any device; slow, for tests)
    "recipe_name": {"tensorwise", "rowwise", "rowwise_with_gw_hp"},  # a torchao recipe, overrides fp8.recipe
    "enable_fsdp_float8_all_gather": bool,  # default: on under FSDP2 with a tensorwise recipe
    "precompute_scales": bool,              # default: on when FP8 all-gather is on
    "pad_inner_dim": bool,
    "round_scales_to_power_of_2": bool,
}


def fast_path_reason(device_backend_cls) -> str | None:
    """Why torchao has no FP8 hardware path on this device, or ``None`` when it has one."""
    device_type = device_backend_cls.torch_type()
    if device_type == "cuda":
        if getattr(torch.version, "hip", None):
            return None  # ROCm MI300+: torchao picks the fnuz FP8 types itself
        cap = device_backend_cls.compute_capability()
        if cap is None:
            return "no NVIDIA GPU was found"
        if cap < (8, 9):
            return (f"the GPU has compute capability {cap[0]}.{cap[1]}; "
                    "FP8 tensor cores need 8.9+ (Ada, Hopper, Blackwell)")
        return None
    return (f"device type '{device_type}' has no FP8 matmul that torchao uses "
            "(NVIDIA compute capability 8.9+ or ROCm MI300+)")


class TorchaoFP8Precision(FP8Precision):
    """torchao Float8 training: converted Linears, optional bf16 autocast around the forward."""

    engine = ENGINE
    priority = 50
    engine_module = "torchao"
    install_hint = "pip install torchbay-fp8-torchao (it requires torchao)"
    accepted_options = OPTIONS
    can_emulate = True

    # -- validation ---------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device_backend_cls, config=None) -> str | None:
        reason = super().unavailable_reason(device_backend_cls, config)
        if reason:
            return reason
        recipe = recipe_of(cls.name, config.fp8) if config is not None else "tensorwise"
        if recipe == "nvfp4":
            return NVFP4_REFUSED
        emulate = config is not None and emulated(config.fp8)
        if recipe in MX_RECIPES:
            device_type = device_backend_cls.torch_type()
            fast = native_reason(device_type, device_backend_cls.compute_capability() if device_type == "cuda"
                                 else None)
            what = f"{recipe.upper()} (MX block scaling)"
        else:
            fast, what = fast_path_reason(device_backend_cls), "FP8"
        if fast and not emulate:
            return (f"it has no {what} hardware path on device '{device_backend_cls.name}': {fast}. Set "
                    f"fp8.emulate: true to emulate its numerics (slower than bf16; for tests and numerics "
                    f"studies), or use mixed_precision: bf16")
        return None

    @classmethod
    def check(cls, context) -> list[str]:
        fp8 = context.config.fp8
        options = dict(fp8.engine_options)
        problems = super().check(context)
        recipe = recipe_of(cls.name, fp8, is_explicit(context, "recipe"))
        if cls.name == "fp4" and recipe not in FP4_RECIPES:
            problems.append(cls.unsupported("recipe", fp8.recipe, "mixed_precision fp4 takes an FP4 recipe: "
                                                                  "mxfp4 (torchao) or nvfp4 (te)"))
        elif cls.name == "fp8" and recipe in FP4_RECIPES:
            problems.append(cls.unsupported("recipe", fp8.recipe, "an FP4 recipe: set mixed_precision: fp4"))
        elif recipe == "nvfp4":
            problems.append(cls.unsupported("recipe", fp8.recipe, NVFP4_REFUSED))
        elif recipe not in RECIPES and recipe not in MX_RECIPES:
            problems.append(cls.unsupported(
                "recipe", fp8.recipe, "torchao offers dynamic scaling: tensorwise (= current), rowwise, and MX block "
                "scaling (mxfp8; mxfp4 under mixed_precision: fp4); for delayed or block scaling use fp8.backend: te"))
        if fp8.format == "E5M2" and is_explicit(context, "format"):
            problems.append(cls.unsupported("format", fp8.format, "torchao trains with E4M3 (HYBRID: E5M2 "
                                                                  "gradients); use E4M3 or HYBRID"))
        if recipe in MX_RECIPES and is_explicit(context, "format"):
            problems.append(cls.unsupported("format", fp8.format, f"{recipe} has its own element format "
                                                                  f"({MX_RECIPES[recipe][1]}); remove fp8.format"))
        if fp8.margin:
            problems.append(cls.unsupported("margin", fp8.margin,
                                            "a margin applies to delayed scaling; set it to 0 or use fp8.backend: te"))
        for key in ("amax_history_len", "amax_compute_algo"):
            if is_explicit(context, key):
                problems.append(cls.unsupported(
                    key, getattr(fp8, key), "amax history belongs to delayed scaling, which torchao does not "
                    "offer; remove the setting or use fp8.backend: te"))
        if options.get("enable_fsdp_float8_all_gather") and not cls._is_fsdp2(context):
            problems.append("fp8.engine_options.enable_fsdp_float8_all_gather needs strategy: fsdp (FSDP2)")
        if options.get("enable_fsdp_float8_all_gather") and cls._recipe_name(fp8, options) != "tensorwise":
            problems.append("fp8.engine_options.enable_fsdp_float8_all_gather works with the tensorwise recipe only "
                            "(torchao); drop it or use fp8.recipe: tensorwise")
        return name_handler_sources(context, problems)

    @staticmethod
    def _is_fsdp2(context) -> bool:
        if getattr(context.strategy_cls, "name", "") != "fsdp":
            return False
        section = getattr(context.config, "fsdp", None)
        return getattr(section, "version", 2) == 2

    @classmethod
    def _recipe_name(cls, fp8, options, explicit: bool = True) -> str:
        recipe = recipe_of(cls.name, fp8, explicit)
        if recipe in MX_RECIPES:
            return recipe
        return options.get("recipe_name") or RECIPES.get(recipe, "tensorwise")

    # -- set-up -------------------------------------------------------------------------
    def __init__(self, context):
        super().__init__(context)
        self.recipe_name = self._recipe_name(self.fp8, self.options, self.is_explicit("recipe"))
        self.mx = self.recipe_name in MX_RECIPES
        self.emulate = emulated(self.fp8)
        fsdp2 = self._is_fsdp2(context)
        self.fsdp_float8_all_gather = bool(self.options.get(
            "enable_fsdp_float8_all_gather", fsdp2 and self.recipe_name == "tensorwise"))
        handler = context.handler(AORecipeKwargs) if hasattr(context, "handler") else None
        self.module_filter = getattr(handler, "module_filter_func", None)
        self.precompute_scales = bool(self.options.get("precompute_scales", self.fsdp_float8_all_gather))
        #: per converted model (in prepare order): the names of the converted Linear modules
        self.converted: list[list[str]] = []
        self.plans: list[LinearPlan] = []
        self._modules: list[torch.nn.Module] = []
        #: how many times the FSDP2 FP8 weight scales were precomputed (after optimizer steps, after loads)
        self.scale_precomputations = 0
        if self.emulate and self.is_main_process:
            log.warning("%s (torchao): emulating %s (fp8.emulate: true): its numerics computed in high precision; "
                        "expect it to be slower than bf16. Use it to test, not to train fast.", self.name,
                        self.recipe_name.upper() if self.mx else "FP8")

    def float8_config(self):
        """The torchao ``Float8LinearConfig`` for this run's settings."""
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.config import CastConfig, e4m3_dtype

        base = Float8LinearConfig.from_recipe_name(self.recipe_name)
        changes: dict[str, Any] = {"emulate": self.emulate,
                                   "enable_fsdp_float8_all_gather": self.fsdp_float8_all_gather}
        for key in ("pad_inner_dim", "round_scales_to_power_of_2"):
            if key in self.options:
                changes[key] = self.options[key]
        if self.is_explicit("format"):
            # HYBRID: gradients in E5M2 (torchao's tensorwise default); E4M3: gradients in E4M3 too.
            # Unset, the torchao recipe's own choice stands (rowwise uses E4M3 throughout).
            from torchao.float8.config import e5m2_dtype

            grad_dtype = e4m3_dtype if self.fp8.format == "E4M3" else e5m2_dtype
            for key in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight"):
                cc = getattr(base, key)
                changes[key] = CastConfig(cc.scaling_type, cc.scaling_granularity, grad_dtype)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        fields.update(changes)
        return Float8LinearConfig(**fields)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if any(id(module) == id(m) for m in self._modules):
            return module
        plan = plan_linears(module, self.fp8, small_below=self.small_layer_filter(),
                            shape_multiple=32 if self.mx else 16, recipe=self.recipe_name,
                            module_filter=self.module_filter)
        if self.mx:
            convert_mx(module, plan.convert, self.recipe_name, self.emulate)
        else:
            from torchao.float8 import convert_to_float8_training

            chosen = set(plan.convert)
            originals = {name: module.get_submodule(name).weight for name in plan.convert}
            module = convert_to_float8_training(module, config=self.float8_config(),
                                                module_filter_fn=lambda mod, fqn: fqn in chosen)
            _keep_parameter_identity(module, originals)
        self.plans.append(plan)
        self.converted.append(list(plan.convert))
        self._modules.append(module)
        main = self.is_main_process
        self.log_plan(plan, f"{self.name} (torchao, recipe {self.recipe_name}{', emulated' if self.emulate else ''}):")
        if not plan.convert and main:
            log.warning("fp8 (torchao): no Linear module of this model was converted, so it trains in %s; see the "
                        "reasons above (fp8.include / fp8.exclude / fp8.keep_first_and_last)",
                        "bf16" if self.fp8.outer_autocast else "full precision")
        warn_small_layers(ENGINE, {n: plan.shapes[n] for n in plan.convert}, self.options, main, self.emulate)
        return module

    def compile_reason(self, module: torch.nn.Module) -> str | None:
        """A module with Float8 Linears runs faster than bf16 only compiled: eager, each cast to FP8
        is its own kernel over the tensor (measured on an H200: eager 0.84x bf16, compiled 1.17-1.38x)."""
        if self.emulate or self.mx or not any(m is module and c for m, c in zip(self._modules, self.converted)):
            return None
        return "fp8 (torchao) runs faster than bf16 only under torch.compile, which fuses its scaling and casts"

    # -- every step ---------------------------------------------------------------------
    def after_optimizer_step(self, optimizer) -> None:
        if self.precompute_scales:
            self.precompute_fsdp_scales()

    def precompute_fsdp_scales(self) -> None:
        """One all-reduce computing every FP8 weight's scale for the next FSDP2 all-gather."""
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for module in self._modules:
            precompute_float8_dynamic_scale_for_fsdp(module)
        self.scale_precomputations += 1

    def fsdp_float8_weights(self) -> list[str]:
        """Names of the weights FSDP2 all-gathers in FP8 (sharded DTensors over torchao's FP8 weight)."""
        from torch.distributed.tensor import DTensor
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        return [f"{i}:{name}" for i, module in enumerate(self._modules) for name, p in module.named_parameters()
                if isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)]

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # dynamic scaling keeps no history: the state is each layer's recipe, to say on load what changed
        return {"engine": ENGINE, "mode": self.name, "recipe": self.recipe_name, "describe": self.describe(),
                "converted": [list(c) for c in self.converted], "layers": [plan.recipes for plan in self.plans]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.saved_here(state) and state.get("layers", [p.recipes for p in self.plans]) != [
                p.recipes for p in self.plans]:
            changed = [f"{name}: {saved[name]} -> {new}" for saved, plan in zip(state.get("layers", []), self.plans)
                       for name, new in plan.recipes.items() if saved.get(name, new) != new]
            if self.is_main_process:  # dynamic scaling carries no state across: a change of recipe is safe
                log.warning("precision: the checkpoint's layers had other recipes; %d change(s): %s", len(changed),
                            "; ".join(changed[:8]) + (" ..." if len(changed) > 8 else ""))
        if self.precompute_scales:
            self.precompute_fsdp_scales()  # the loaded weights need fresh scales before the next all-gather

    def describe(self) -> str:
        return f"{self.name}:torchao:{self.recipe_name}{':emulated' if self.emulate else ''}"


class TorchaoFP4Precision(TorchaoFP8Precision):
    """``mixed_precision: fp4`` on torchao: MXFP4 (``fp8.recipe: mxfp4``, the default here); the ``fp8``
    section configures it (policy, emulation)."""

    name = "fp4"


def emulated(fp8) -> bool:
    """``fp8.emulate``, or the older ``fp8.engine_options.emulate``."""
    return bool(fp8.emulate or fp8.engine_options.get("emulate", False))


def _keep_parameter_identity(model: torch.nn.Module, originals: dict[str, torch.nn.Parameter]) -> None:
    """Put each converted weight back into the user's own ``nn.Parameter`` object.

    With FSDP float8 all-gather, torchao wraps the weight in a new Parameter (a tensor
    subclass); an optimizer built before ``prepare`` would then hold the old one and never
    train the FP8 layers. ``torch.utils.swap_tensors`` moves the new contents (class
    included) into the original object, which the module then holds again.
    """
    for name, old in originals.items():
        owner = model.get_submodule(name)
        new = owner.weight
        if new is not old:
            if getattr(new, "_tensor", None) is old:
                # the wrapper holds the original as its inner tensor: give it a plain view of the
                # same storage instead, or after the swap it would hold itself
                new._tensor = old.detach()
            torch.utils.swap_tensors(old, new)
            owner.weight = old
