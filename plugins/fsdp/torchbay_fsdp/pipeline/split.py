"""Where a model is cut into pipeline stages: at the boundaries of its repeated block list.

A model with a ``ModuleList`` of blocks (every Hugging Face decoder, torchtitan-style models,
torchbay's examples) is cut between blocks. Modules that own parameters and come before the
block list (in registration order: embeddings) go to the first stage, those after it (final
norm, head) to the last. Without split points, the blocks are balanced by parameter count
(the first stage's count includes the embeddings, the last's the head). ``pp_split_points``
names the blocks that start a new stage (``["blocks.2", "blocks.4"]``: torch's
``SplitPoint.BEGINNING``). No process group, no device: a plan is computed from the module tree
alone (a model on the meta device works).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchbay.errors import ConfigError
from torchbay_fsdp.pipeline.schedule import stage_indices


@dataclass(frozen=True)
class SplitPlan:
    """The model's parts: ``blocks`` (the name of the block list), the names of its ``pre`` and
    ``post`` modules, and each stage's ``[start, stop)`` range of block indices."""

    blocks: str
    num_blocks: int
    pre: tuple[str, ...]
    post: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    def owns(self, stage: int, name: str) -> bool:
        """Whether parameter/buffer/module ``name`` belongs to ``stage``."""
        prefix = self.blocks + "."
        if name.startswith(prefix):
            start, stop = self.ranges[stage]
            return start <= int(name[len(prefix):].split(".")[0]) < stop
        if any(name == p or name.startswith(p + ".") for p in self.pre):
            return stage == 0
        if any(name == p or name.startswith(p + ".") for p in self.post):
            return stage == self.num_stages - 1
        return True  # parameter-free glue (rotary embeddings, dropout): every stage

    def describe(self) -> str:
        parts = []
        for i, (start, stop) in enumerate(self.ranges):
            extra = (["+".join(self.pre)] if i == 0 and self.pre else []) + \
                (["+".join(self.post)] if i == self.num_stages - 1 and self.post else [])
            parts.append(f"stage {i}: {self.blocks}[{start}:{stop}]" + (f" ({', '.join(extra)})" if extra else ""))
        return "; ".join(parts)


def find_block_list(model: torch.nn.Module) -> str | None:
    """The name of the model's repeated block list: the ``ModuleList`` of at least two modules of one class
    holding the most parameters (ties: the first)."""
    best, best_count = None, -1
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        count = sum(p.numel() for p in module.parameters())
        if count > best_count:
            best, best_count = name, count
    return best


def plan_split(model: torch.nn.Module, num_stages: int, split_points: list[str] | None = None,
               where: str = "parallelism") -> SplitPlan:
    """The :class:`SplitPlan` of ``model`` into ``num_stages`` stages (errors name the setting and the fix)."""
    blocks = find_block_list(model)
    if blocks is None:
        raise ConfigError(f"{where}.pp_size: {type(model).__name__} has no block list (a torch.nn.ModuleList of "
                          f"repeated blocks) to cut into {num_stages} pipeline stages; give the model one (e.g. "
                          f"self.layers = nn.ModuleList(...)), or set {where}.pp_size 1")
    block_list = model.get_submodule(blocks)
    n = len(block_list)
    pre, post = _outside(model, blocks)
    counts = [sum(p.numel() for p in b.parameters()) for b in block_list]
    if split_points:
        ranges = _ranges_from_points(split_points, blocks, n, num_stages, where)
    else:
        if n < num_stages:
            raise ConfigError(f"{where}.pp_size {num_stages}: {type(model).__name__}.{blocks} has {n} blocks, fewer "
                              f"than the {num_stages} pipeline stages (each stage needs one); lower pp_size (or the "
                              f"virtual stages of an interleaved schedule)")
        params = dict(model.named_parameters())
        head = sum(p.numel() for name, p in params.items() if _under(name, pre))
        tail = sum(p.numel() for name, p in params.items() if _under(name, post))
        ranges = balance(counts, num_stages, head, tail)
    plan = SplitPlan(blocks, n, tuple(pre), tuple(post), tuple(ranges))
    _refuse_ties_across_stages(model, plan, where)
    return plan


def _refuse_ties_across_stages(model: torch.nn.Module, plan: SplitPlan, where: str) -> None:
    """A parameter shared by modules of two stages (an output head tied to the input embedding) would become two
    copies, each trained with half of its gradient: refused, with the way out."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        stages = {next(s for s in range(plan.num_stages) if plan.owns(s, name)) for name in names}
        if len(stages) > 1:
            raise ConfigError(f"{where}.pp_size {plan.num_stages}: {type(model).__name__} ties {' and '.join(names)} "
                              f"(one parameter), which the split puts on stages {sorted(stages)}; each stage would "
                              f"train its own copy. Untie them (a Hugging Face model: tie_word_embeddings=False in its "
                              f"config), or choose pp_split_points that keep them on one stage, or set pp_size 1")


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _outside(model: torch.nn.Module, blocks: str) -> tuple[list[str], list[str]]:
    """Modules outside the block list that own parameters directly, before and after it in
    registration order (the outermost such module of each subtree)."""
    pre, post, seen_blocks = [], [], False
    for name, module in model.named_modules():
        if name == blocks:
            seen_blocks = True
            continue
        if name.startswith(blocks + ".") or _under(name, pre) or _under(name, post):
            continue
        if next(module.parameters(recurse=False), None) is not None:
            (post if seen_blocks else pre).append(name)
    if "" in pre:
        raise ConfigError(f"{type(model).__name__} holds parameters directly (not in a submodule), which cannot be "
                          f"placed on one pipeline stage; move them into a submodule (e.g. an nn.Embedding), or set "
                          f"parallelism.pp_size 1")
    return pre, post


def balance(counts: list[int], num_stages: int, head: int = 0, tail: int = 0) -> list[tuple[int, int]]:
    """Contiguous ranges of ``counts`` (one per stage, none empty) minimising the largest stage, the
    first stage also holding ``head`` and the last ``tail`` (exact: dynamic programming)."""
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)

    def load(stage: int, start: int, stop: int) -> int:
        return prefix[stop] - prefix[start] + (head if stage == 0 else 0) + (tail if stage == num_stages - 1 else 0)

    inf = float("inf")
    # best[s][i]: the smallest largest-stage over stages 0..s-1 holding blocks [0, i)
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], load(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def _ranges_from_points(points: list[str], blocks: str, n: int, num_stages: int, where: str):
    starts = []
    for point in points:
        prefix = blocks + "."
        index = point[len(prefix):] if point.startswith(prefix) else None
        if index is None or not index.isdigit() or not 0 < int(index) < n:
            raise ConfigError(f"{where}.pp_split_points: {point!r} is not a block that can start a stage; name one "
                              f"of {blocks}.1 ... {blocks}.{n - 1} (each starts a new stage)")
        starts.append(int(index))
    if sorted(set(starts)) != starts:
        raise ConfigError(f"{where}.pp_split_points {points}: give distinct blocks in increasing order")
    if len(starts) != num_stages - 1:
        raise ConfigError(f"{where}.pp_split_points names {len(starts)} points but {num_stages} stages need "
                          f"{num_stages - 1}; give pp_size x virtual stages - 1 points, or leave it empty to balance "
                          f"by parameter count")
    bounds = [0] + starts + [n]
    return [(bounds[i], bounds[i + 1]) for i in range(num_stages)]


def stage_parameter_counts(model: torch.nn.Module, plan: SplitPlan) -> list[int]:
    """Parameters each stage of ``plan`` holds (a model on the meta device works)."""
    counts = [0] * plan.num_stages
    for name, p in model.named_parameters():
        owners = [s for s in range(plan.num_stages) if plan.owns(s, name)]
        for s in owners:
            counts[s] += p.numel()
    return counts


def memory_counts(section, model: torch.nn.Module) -> dict[str, int]:
    """``torchbay estimate-memory``'s counts for a pipeline: each rank's parameters (``pp_rank_<r>``: the stages
    it holds) and the largest (``pp_rank_max``)."""
    pp, schedule, virtual = section.pp_size, section.pp_schedule, section.pp_virtual_stages
    held = [stage_indices(schedule, r, pp, virtual) for r in range(pp)]
    plan = plan_split(model, pp * len(held[0]), list(section.pp_split_points) or None)
    per_stage = stage_parameter_counts(model, plan)
    per_rank = [sum(per_stage[s] for s in stages) for stages in held]
    return {**{f"pp_rank_{r}": n for r, n in enumerate(per_rank)}, "pp_rank_max": max(per_rank)}
