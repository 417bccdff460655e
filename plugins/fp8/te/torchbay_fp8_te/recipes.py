"""fp8 config section -> Transformer Engine recipe, as plain data first (testable without TE).

| fp8.recipe | TE recipe | uses |
|---|---|---|
| delayed | ``DelayedScaling`` | format, margin, amax_history_len, amax_compute_algo |
| tensorwise, current | ``Float8CurrentScaling`` | format |
| block | ``Float8BlockScaling`` (TE 2.3+, Hopper) | format (E4M3 unless set) |
| mxfp8 | ``MXFP8BlockScaling`` (Blackwell) | format (E4M3 unless set) |
| nvfp4 | ``NVFP4BlockScaling`` (TE 2.8+, Blackwell; ``mixed_precision: fp4``, its default there) | |
| rowwise, mxfp4 | none: an error naming te and the setting | |

``fp8.engine_options.recipe_kwargs`` (a mapping) is passed to the recipe as is.
"""

from __future__ import annotations

from typing import Any

RECIPE_CLASSES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
                  "current": "Float8CurrentScaling", "block": "Float8BlockScaling",
                  "mxfp8": "MXFP8BlockScaling", "nvfp4": "NVFP4BlockScaling"}
FP4_RECIPES = ("nvfp4",)


def recipe_of(fp8, explicit=lambda key: True, mode: str = "fp8") -> str:
    """The recipe of a run of ``mode``: ``fp8.recipe``; under fp4 when it was not set, ``nvfp4``."""
    if mode == "fp4" and not explicit("recipe"):
        return "nvfp4"
    return fp8.recipe
DELAYED_ONLY = ("margin", "amax_history_len", "amax_compute_algo")


def recipe_spec(fp8, explicit=lambda key: True, mode: str = "fp8") -> tuple[str, dict[str, Any]]:
    """``(TE recipe class name, constructor kwargs)`` with formats as ``Format`` member names.

    ``explicit(key)`` says whether ``fp8.<key>`` was set by the user; block-scaled recipes
    keep TE's own E4M3 default when the format was not set.
    """
    recipe = recipe_of(fp8, explicit, mode)
    cls_name = RECIPE_CLASSES[recipe]
    kwargs: dict[str, Any] = {}
    if recipe == "nvfp4":
        pass  # FP4 E2M1 elements: the recipe's own format
    elif recipe in ("block", "mxfp8") and not explicit("format"):
        kwargs["fp8_format"] = "E4M3"
    else:
        kwargs["fp8_format"] = fp8.format
    if recipe == "delayed":
        kwargs.update(margin=fp8.margin, amax_history_len=fp8.amax_history_len,
                      amax_compute_algo=fp8.amax_compute_algo)
    kwargs.update(dict(fp8.engine_options.get("recipe_kwargs", {}) or {}))
    return cls_name, kwargs


def recipe_problems(fp8, explicit=lambda key: True, mode: str = "fp8") -> list[str]:
    problems = []
    recipe = recipe_of(fp8, explicit, mode)
    if recipe not in RECIPE_CLASSES:
        problems.append(f"fp8 engine 'te' cannot honour fp8.recipe = {fp8.recipe!r}: Transformer Engine has no "
                        f"{recipe} recipe; use current (per-tensor), block, mxfp8 or (fp4) nvfp4, or fp8.backend: "
                        "torchao")
        return problems
    if (mode == "fp4") != (recipe in FP4_RECIPES):
        problems.append(f"fp8 engine 'te' cannot honour fp8.recipe = {fp8.recipe!r} with mixed_precision {mode}: "
                        + ("use nvfp4 (or leave it unset)" if mode == "fp4" else "an FP4 recipe: set "
                           "mixed_precision: fp4"))
    if recipe == "nvfp4" and explicit("format"):
        problems.append(f"fp8 engine 'te' cannot honour fp8.format = {fp8.format!r} with nvfp4: it has its own "
                        "element format (FP4 E2M1); remove fp8.format")
    if recipe != "delayed":
        for key in DELAYED_ONLY:
            if explicit(key) and (key != "margin" or fp8.margin):
                problems.append(f"fp8 engine 'te' cannot honour fp8.{key} = {getattr(fp8, key)!r} with fp8.recipe "
                                f"{fp8.recipe!r}: it applies to delayed scaling only; "
                                "use fp8.recipe: delayed or drop it")
    return problems


def build_recipe(fp8, explicit=lambda key: True, mode: str = "fp8"):
    """The Transformer Engine recipe object (imports transformer_engine)."""
    from transformer_engine.common import recipe as te_recipe

    cls_name, kwargs = recipe_spec(fp8, explicit, mode)
    cls = getattr(te_recipe, cls_name, None)
    if cls is None:
        import transformer_engine

        raise RuntimeError(f"fp8.recipe {fp8.recipe!r} needs transformer_engine.common.recipe.{cls_name}, which "
                           f"Transformer Engine {getattr(transformer_engine, '__version__', '?')} lacks; upgrade it")
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    return cls(**kwargs)
