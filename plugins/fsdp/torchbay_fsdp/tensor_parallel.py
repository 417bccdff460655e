"""Tensor parallelism on any module: a plan of module-name patterns -> styles, applied with
torch's ``parallelize_module`` on the ``tp`` dimension of the mesh.

Style strings are Hugging Face's names, mapped onto torch's own ``ParallelStyle`` classes:

=================== ==================================================================
``colwise``         ``ColwiseParallel()``: weight rows (output features) split; the output
                    is this rank's slice of the features (a plain tensor)
``rowwise``         ``RowwiseParallel()``: weight columns (input features) split; takes the
                    feature slice a ``colwise`` layer produced, all-reduces the output
``colwise_rep``     ``ColwiseParallel(output_layouts=Replicate())``: output gathered whole
``rowwise_rep``     ``RowwiseParallel(input_layouts=Replicate())``: takes a whole input
``local_colwise``   ``ColwiseParallel(use_local_output=False)``: output stays a sharded DTensor
``local_rowwise``   ``RowwiseParallel(input_layouts=Shard(-1), use_local_output=False)``
``replicate``       parameters replicated on the tp mesh (DTensors; no communication)
``sequence_parallel`` ``SequenceParallel()``: norms/dropout on sequence-sharded activations
=================== ==================================================================

A pattern's ``*`` matches one component of a module's dotted name (``blocks.*.mlp.up``).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

from torchbay.errors import ConfigError

STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "local_colwise", "local_rowwise", "replicate",
          "sequence_parallel")
#: styles that split a weight: which dimension of an nn.Linear / nn.Embedding weight each one splits
_SPLIT_DIM = {"colwise": {"Linear": 0, "Embedding": 1}, "rowwise": {"Linear": 1, "Embedding": 0}}


def style_kind(value: Any) -> str | None:
    """``colwise`` / ``rowwise`` for a style (string or torch object) that splits weights, else None."""
    if isinstance(value, str):
        return "colwise" if "colwise" in value else "rowwise" if "rowwise" in value else None
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ("colwise" if isinstance(value, ColwiseParallel)
            else "rowwise" if isinstance(value, RowwiseParallel) else None)


def check_styles(plan: dict, where: str = "parallelism.tp_plan") -> list[str]:
    """Problems with the styles of a plan (no model needed: run before any process group)."""
    problems = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            problems.append(f"{where}: the key {pattern!r} is not a module-name pattern")
        if isinstance(style, str):
            if style not in STYLES:
                problems.append(f"{where}[{pattern!r}] = {style!r} is not a style torchbay supports; use one of "
                                f"{', '.join(STYLES)}, or a torch ParallelStyle object")
        elif not _is_parallel_style(style):
            problems.append(f"{where}[{pattern!r}] is a {type(style).__name__}; give a style name "
                            f"({', '.join(STYLES)}) or a torch.distributed.tensor.parallel.ParallelStyle")
    return problems


def _is_parallel_style(value: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(value, ParallelStyle)


def to_style(value: Any):
    """The torch ``ParallelStyle`` for a style string (objects pass through)."""
    if not isinstance(value, str):
        return value
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if value == "colwise":
        return ColwiseParallel()
    if value == "rowwise":
        return RowwiseParallel()
    if value == "colwise_rep":
        return ColwiseParallel(output_layouts=Replicate())
    if value == "rowwise_rep":
        return RowwiseParallel(input_layouts=Replicate())
    if value == "local_colwise":
        return ColwiseParallel(use_local_output=False)
    if value == "local_rowwise":
        return RowwiseParallel(input_layouts=Shard(-1), use_local_output=False)
    if value == "replicate":
        return ReplicateParallel()
    if value == "sequence_parallel":
        return SequenceParallel()
    raise ConfigError(check_styles({"?": value})[0])


def ReplicateParallel():  # noqa: N802 (a ParallelStyle factory, named like one)
    """Parameters become replicated DTensors on the tp mesh; inputs and outputs stay plain tensors."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    class _Replicate(PrepareModuleInputOutput):
        def __init__(self):
            super().__init__(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                             output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),),
                             use_local_input=False, use_local_output=True)

        def _apply(self, module, device_mesh):
            from torch.distributed.tensor import distribute_module

            module = super()._apply(module, device_mesh)
            return distribute_module(module, device_mesh)  # parameters: Replicate() DTensors

    return _Replicate()


def model_plan(model: torch.nn.Module) -> dict:
    """The model's own plan: its ``tp_plan`` attribute, else every submodule's ``_tp_plan``
    (Hugging Face models keep one per class), prefixed with the submodule's name."""
    own = getattr(model, "tp_plan", None)
    if isinstance(own, dict) and own:
        return dict(own)
    plan: dict = {}
    for name, module in model.named_modules():
        part = getattr(module, "_tp_plan", None)
        if isinstance(part, dict):
            plan.update({(f"{name}.{k}" if name else k): v for k, v in part.items()})
    return plan


def _matches(pattern: str, name: str) -> bool:
    parts, atoms = pattern.split("."), name.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(a, p) for p, a in zip(parts, atoms))


def resolve_plan(model: torch.nn.Module, plan: dict, tp_size: int, where: str) -> dict[str, Any]:
    """Module name -> style for every module a pattern matches; every problem raised at once."""
    problems = check_styles(plan, where)
    modules = dict(model.named_modules())
    resolved: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            continue
        hits = [name for name in modules if name and _matches(pattern, name)]
        if not hits:
            problems.append(f"{where}[{pattern!r}] matches no module of {type(model).__name__} (its modules "
                            f"include {', '.join(list(n for n in modules if n)[:8])}...); fix the pattern "
                            f"(* matches one name component)")
        for name in hits:
            if name in resolved:
                problems.append(f"{where}: module {name!r} is matched by two patterns; keep one")
            resolved[name] = style
            problems += _split_problems(name, modules[name], style, tp_size, where)
    if problems:
        raise ConfigError(problems, header="tensor parallel plan cannot be applied")
    return resolved


def _split_problems(name: str, module: torch.nn.Module, style: Any, tp_size: int, where: str) -> list[str]:
    kind = style_kind(style)
    if kind is None:
        return []
    dims = _SPLIT_DIM[kind]
    cls = next((c for c in ("Linear", "Embedding") if isinstance(module, getattr(torch.nn, c))), None)
    if cls is None:
        return [f"{where}: {name!r} is a {type(module).__name__}; {kind} splits only nn.Linear and nn.Embedding "
                f"layers; use a plan entry for the layers inside it"]
    dim = dims[cls]
    size = module.weight.shape[dim]
    if size % tp_size:
        what = {("Linear", 0): "out_features", ("Linear", 1): "in_features", ("Embedding", 0): "num_embeddings",
                ("Embedding", 1): "embedding_dim"}[(cls, dim)]
        return [f"{where}: {name!r} ({kind}) splits {what} {size} over parallelism.tp_size {tp_size}, which does "
                f"not divide it; choose a tp_size that divides {size}, or leave {name!r} out of the plan"]
    return []


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, plan: dict, tp_size: int, where: str) -> dict:
    """Apply the plan with ``parallelize_module``; return the resolved module -> style mapping."""
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = resolve_plan(model, plan, tp_size, where)
    parallelize_module(model, tp_mesh, {name: to_style(style) for name, style in resolved.items()})
    return resolved
