"""Which ``nn.Linear`` modules an FP8 engine converts, and which are too small to gain.

- :func:`plan_linears`: the per-layer policy every engine applies: ``fp8.include`` / ``fp8.exclude``
  regexes, both dimensions multiples of 16 (32 for MX block scaling), the small-layer filter, first and
  last Linear kept in higher precision unless ``fp8.keep_first_and_last: false``, and the positional
  block rules (``fp8.keep_first_blocks``, ``keep_last_blocks``, ``keep_last_blocks_fraction``);
  :meth:`LinearPlan.table` is the layer -> recipe table engines log once;
- :func:`small_layers` / :func:`warn_small_layers`: the "too small to gain" rule.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("torchbay.fp8")

#: A Linear of ``in_features=K``, ``out_features=N`` is reported as too small to gain from
#: FP8 when ``K*N/(K+N)`` (its "harmonic size") is below this. Why: FP8 halves the time of
#: the three GEMMs, ``3*M*K*N`` multiply-adds at bf16 peak P, while the casts to FP8 read and
#: write roughly ``9*(M*K + K*N + M*N)`` bytes at memory bandwidth B; with many tokens M the
#: gain is positive only when ``K*N/(K+N) > ~3*P/B``, about 900 on an H100 (P ~ 990 TFLOP/s,
#: B ~ 3.35 TB/s). published H100 measurements agree (1024-wide layers lose, 4096-wide gain);
#: ``benchmarks/bench_fp8.py`` measures it per hidden size on the machine at hand.
SMALL_LAYER_HARMONIC = 1024


@dataclass
class LinearPlan:
    """Which Linear modules to convert (``convert``) and why the others are left (``skipped``)."""

    convert: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the recipe of each converted layer (one per run today; a dict so a checkpoint records it per layer)
    recipe: str = ""

    @property
    def recipes(self) -> dict[str, str]:
        """``{layer: recipe}`` for every Linear: the recipe, or ``high precision`` where the policy kept it."""
        return {name: (self.recipe if name in self.convert else "high precision") for name in self.shapes}

    def table(self, high: str = "bf16") -> str:
        """The layer -> recipe table (plain text, one row per Linear) with why each kept layer was kept."""
        rows = [("layer", "shape", "recipe", "why")]
        for name, (k, n) in self.shapes.items():
            kept = name not in self.convert
            rows.append((name or "<root>", f"{k}->{n}", high if kept else self.recipe,
                         self.skipped.get(name, "") if kept else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + ("  " + r[3] if r[3] else "")
                         for r in rows)

    def describe(self) -> str:
        lines = [f"{name} ({k}->{n})" for name, (k, n) in self.shapes.items() if name in self.convert]
        target = "FP4" if self.recipe in ("mxfp4", "nvfp4") else "FP8"
        out = f"{len(self.convert)} Linear module(s) converted to {target}: " + (", ".join(lines) or "none")
        if self.skipped:
            out += "; kept in higher precision: " + "; ".join(f"{n or '<root>'}: {why}"
                                                               for n, why in self.skipped.items())
        return out


def fp8_gemm_shape(module: torch.nn.Linear, multiple: int = 16) -> bool:
    """Whether FP8 GEMMs can run ``module``: both its dimensions are multiples of 16 (``multiple``)."""
    return module.in_features % multiple == 0 and module.out_features % multiple == 0


def find_blocks(model: torch.nn.Module, container: str | None = None) -> list[str]:
    """The names of the model's repeated blocks: the children of ``container`` (``fp8.blocks``), or of the
    longest ``nn.ModuleList`` (the first of equal length); ``[]`` without one."""
    if container is not None:
        lists = [(container, model.get_submodule(container))]
    else:
        lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda nm: len(nm[1]))
    return [f"{name}.{child}" if name else child for child, _ in blocks.named_children()]


def positional_keeps(model: torch.nn.Module, fp8) -> dict[str, str]:
    """``{block name: why}`` for the blocks the positional rules keep in higher precision."""
    if not (fp8.keep_first_blocks or fp8.keep_last_blocks or fp8.keep_last_blocks_fraction):
        return {}
    blocks = find_blocks(model, fp8.blocks)
    total = len(blocks)
    count = max(fp8.keep_last_blocks, math.ceil(round(fp8.keep_last_blocks_fraction * total, 6)))
    keeps = {}
    for index, name in enumerate(blocks):
        if index < fp8.keep_first_blocks:
            keeps[name] = f"block {index} of {total}: one of the first {fp8.keep_first_blocks} (fp8.keep_first_blocks)"
        elif index >= total - count:
            rule = ("fp8.keep_last_blocks" if count == fp8.keep_last_blocks
                    else f"fp8.keep_last_blocks_fraction {fp8.keep_last_blocks_fraction:g}")
            keeps[name] = f"block {index} of {total}: one of the last {count} ({rule})"
    return keeps


def plan_linears(model: torch.nn.Module, fp8, *, exact_type: type = torch.nn.Linear,
                 small_below: float = 0, shape_multiple: int = 16, recipe: str = "",
                 module_filter=None) -> LinearPlan:
    """Decide which ``exact_type`` modules of ``model`` to convert, from the ``fp8`` config section.

    Only modules whose type is exactly ``exact_type`` are candidates: subclasses (an engine's
    own FP8 Linear, ``NonDynamicallyQuantizableLinear`` inside attention) are left alone.
    "First" and "last" follow ``named_modules()`` order (registration order). ``small_below``:
    a Linear whose ``K*N/(K+N)`` is below it stays in higher precision (0: none does).
    ``shape_multiple``: what both dimensions must be multiples of (32 for MX block scaling).
    ``module_filter(module, name)``: the user's own filter (Accelerate's ``module_filter_func``), and-ed in.
    """
    include = [re.compile(p) for p in fp8.include]
    exclude = [re.compile(p) for p in fp8.exclude]
    kept_blocks = positional_keeps(model, fp8)
    plan = LinearPlan(recipe=recipe)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    candidates = []
    for name, module in linears:
        plan.shapes[name] = (module.in_features, module.out_features)
        if type(module) is not exact_type:
            plan.skipped[name] = f"{type(module).__name__} is not a plain {exact_type.__name__}"
        elif any(p.search(name) for p in exclude):
            plan.skipped[name] = "matched by fp8.exclude"
        elif include and not any(p.search(name) for p in include):
            plan.skipped[name] = "not matched by fp8.include"
        elif not fp8_gemm_shape(module, shape_multiple):
            plan.skipped[name] = (f"shape {module.in_features}->{module.out_features}: {recipe or 'FP8'} GEMMs "
                                  f"need both dimensions to be multiples of {shape_multiple}")
        elif module_filter is not None and not module_filter(module, name):
            plan.skipped[name] = "left out by the module_filter_func of AORecipeKwargs"
        elif any(name.startswith(block + ".") for block in kept_blocks):
            plan.skipped[name] = next(why for block, why in kept_blocks.items() if name.startswith(block + "."))
        elif harmonic_size(module.in_features, module.out_features) < small_below:
            plan.skipped[name] = (f"too small to gain from FP8: K*N/(K+N) = "
                                  f"{harmonic_size(module.in_features, module.out_features):.0f} < {small_below:g} "
                                  f"(fp8.filter_small_layers)")
        else:
            candidates.append(name)
    if fp8.keep_first_and_last and linears:
        for name, why in ((linears[0][0], "first"), (linears[-1][0], "last")):
            if name in candidates:
                candidates.remove(name)
                plan.skipped[name] = f"{why} Linear kept in higher precision (fp8.keep_first_and_last)"
    plan.convert = candidates
    return plan


def harmonic_size(in_features: int, out_features: int) -> float:
    return in_features * out_features / (in_features + out_features)


def small_layers(shapes: dict[str, tuple[int, int]], threshold: float = SMALL_LAYER_HARMONIC) -> list[str]:
    """Names whose ``K*N/(K+N)`` is below ``threshold`` (see :data:`SMALL_LAYER_HARMONIC`)."""
    return [name for name, (k, n) in shapes.items() if harmonic_size(k, n) < threshold]


def warn_small_layers(engine: str, shapes: dict[str, tuple[int, int]], options: dict[str, Any],
                      is_main: bool, emulated: bool = False) -> list[str]:
    """Log one warning (main process) naming the converted layers too small to gain; return them.

    ``fp8.engine_options.small_layer_threshold`` changes the threshold (0 turns it off).
    """
    threshold = options.get("small_layer_threshold", SMALL_LAYER_HARMONIC)
    small = small_layers(shapes, threshold) if threshold else []
    if small and is_main:
        listed = ", ".join(f"{n} ({shapes[n][0]}->{shapes[n][1]})" for n in small[:20])
        more = f" and {len(small) - 20} more" if len(small) > 20 else ""
        log.warning(
            "fp8 (%s): %d of %d FP8 layer(s) are too small to run faster than bf16: %s%s. A Linear K->N gains "
            "only when K*N/(K+N) >= %s (about 2048x2048 and up); the FP8 casts cost more than the faster "
            "GEMM saves below that. Exclude them with fp8.exclude, or use mixed_precision: bf16 for this model "
            "(set fp8.engine_options.small_layer_threshold: 0 to silence this).%s",
            engine, len(small), len(shapes), listed, more, threshold,
            " (This run emulates FP8 and is slower than bf16 anyway.)" if emulated else "")
    return small
