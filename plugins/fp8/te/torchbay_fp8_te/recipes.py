"""fp8 config section -> Transformer Engine recipe, as plain data first (testable without TE).

| fp8.recipe | TE recipe | uses |
|---|---|---|
| delayed | ``DelayedScaling`` | format, margin, amax_history_len, amax_compute_algo |
| tensorwise, current | ``Float8CurrentScaling`` | format |
| block | ``Float8BlockScaling`` (TE 2.3+, Hopper) | format (E4M3 unless set) |
| mxfp8 | ``MXFP8BlockScaling`` (Blackwell) | format (E4M3 unless set) |
| rowwise | none: an error naming te and the setting | |

``fp8.engine_options.recipe_kwargs`` (a mapping) is passed to the recipe as is.
"""

from __future__ import annotations

from typing import Any

RECIPE_CLASSES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
                  "current": "Float8CurrentScaling", "block": "Float8BlockScaling",
                  "mxfp8": "MXFP8BlockScaling"}
DELAYED_ONLY = ("margin", "amax_history_len", "amax_compute_algo")


def recipe_spec(fp8, explicit=lambda key: True) -> tuple[str, dict[str, Any]]:
    """``(TE recipe class name, constructor kwargs)`` with formats as ``Format`` member names.

    ``explicit(key)`` says whether ``fp8.<key>`` was set by the user; block-scaled recipes
    keep TE's own E4M3 default when the format was not set.
    """
    cls_name = RECIPE_CLASSES[fp8.recipe]
    kwargs: dict[str, Any] = {}
    if fp8.recipe in ("block", "mxfp8") and not explicit("format"):
        kwargs["fp8_format"] = "E4M3"
    else:
        kwargs["fp8_format"] = fp8.format
    if fp8.recipe == "delayed":
        kwargs.update(margin=fp8.margin, amax_history_len=fp8.amax_history_len,
                      amax_compute_algo=fp8.amax_compute_algo)
    kwargs.update(dict(fp8.engine_options.get("recipe_kwargs", {}) or {}))
    return cls_name, kwargs


def recipe_problems(fp8, explicit=lambda key: True) -> list[str]:
    problems = []
    if fp8.recipe not in RECIPE_CLASSES:
        problems.append(f"fp8 engine 'te' cannot honour fp8.recipe = {fp8.recipe!r}: Transformer Engine has no "
                        f"rowwise recipe; use current (per-tensor), block or mxfp8, or fp8.backend: torchao")
        return problems
    if fp8.recipe != "delayed":
        for key in DELAYED_ONLY:
            if explicit(key) and (key != "margin" or fp8.margin):
                problems.append(f"fp8 engine 'te' cannot honour fp8.{key} = {getattr(fp8, key)!r} with fp8.recipe "
                                f"{fp8.recipe!r}: it applies to delayed scaling only; "
                                "use fp8.recipe: delayed or drop it")
    return problems


def build_recipe(fp8, explicit=lambda key: True):
    """The Transformer Engine recipe object (imports transformer_engine)."""
    from transformer_engine.common import recipe as te_recipe

    cls_name, kwargs = recipe_spec(fp8, explicit)
    cls = getattr(te_recipe, cls_name, None)
    if cls is None:
        import transformer_engine

        raise RuntimeError(f"fp8.recipe {fp8.recipe!r} needs transformer_engine.common.recipe.{cls_name}, which "
                           f"Transformer Engine {getattr(transformer_engine, '__version__', '?')} lacks; upgrade it")
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    return cls(**kwargs)
