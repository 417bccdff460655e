"""Which modules are experts, and how each kind is split over the ep group.

Recognised out of the box (or named by ``parallelism.ep_plan`` module-name patterns, ``*`` = one name component):

- a torchtitan-style grouped-experts module: 3-D weights ``w1`` / ``w2`` / ``w3`` (experts first) and
  ``forward(x, num_tokens_per_expert)`` on rows sorted by expert;
- transformers 5's merged experts (Mixtral, Qwen3-MoE...): 3-D ``gate_up_proj`` / ``down_proj`` and
  ``forward(hidden_states, top_k_index, top_k_weights)``.

Each rank keeps its ``E / ep`` experts (the weights' first dimension); the module's forward is wrapped so that
its rows go to the rank holding their expert and come back (:mod:`.dispatch`). The router is not touched: it is
replicated like every other non-expert weight (FSDP2 over dp_shard), and a load-balancing loss is unchanged.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from torchbay.errors import ConfigError
from torchbay_fsdp.experts.dispatch import dispatch_compute_combine

GROUPED = ("w1", "w2", "w3")
MERGED = ("gate_up_proj", "down_proj")


def kind_of(module: nn.Module) -> str | None:
    """``"grouped"`` (torchtitan style), ``"merged"`` (transformers 5) or None."""
    params = dict(module.named_parameters(recurse=False))
    if all(name in params and params[name].ndim == 3 for name in GROUPED):
        return "grouped"
    if all(name in params and params[name].ndim == 3 for name in MERGED):
        return "merged"
    return None


def _matches(pattern: str, name: str) -> bool:
    parts, atoms = pattern.split("."), name.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(a, p) for p, a in zip(parts, atoms))


def find_experts(model: nn.Module, plan: list[str] | None, ep: int) -> dict[str, nn.Module]:
    """The expert modules of ``model`` by name: those ``plan`` names, else every recognised one; checked."""
    where = "parallelism.ep_plan" if plan else f"{type(model).__name__} (recognised expert modules)"
    modules = dict(model.named_modules())
    if not plan:  # the model's declaration: transformers' _ep_plan names expert weights, whose modules are meant
        declared = getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None) or []
        plan = sorted({p if any(_matches(p, n) for n in modules) else p.rpartition(".")[0] for p in declared})
        plan = [p for p in plan if p and any(_matches(p, n) and kind_of(modules[n]) for n in modules)]
    if plan:
        found = {n: m for n, m in modules.items() if any(_matches(p, n) for p in plan)}
        unmatched = [p for p in plan if not any(_matches(p, n) for n in modules)]
        if unmatched:
            raise ConfigError(f"parallelism.ep_plan {unmatched} matches no module of {type(model).__name__}; give "
                              f"the expert modules' names (e.g. 'layers.*.moe.experts')")
    else:
        found = {n: m for n, m in modules.items() if kind_of(m)}
    if not found:
        raise ConfigError(f"parallelism.ep_size {ep}: {type(model).__name__} has no expert module torchbay "
                          f"recognises (3-D w1/w2/w3 or gate_up_proj/down_proj weights); name them in "
                          f"parallelism.ep_plan, or set ep_size 1")
    for name, module in found.items():
        kind = kind_of(module)
        if kind is None:
            raise ConfigError(f"{where}: {name} ({type(module).__name__}) is not a grouped-experts module (3-D "
                              f"w1/w2/w3 or gate_up_proj/down_proj weights, experts first)")
        experts = getattr(module, GROUPED[0] if kind == "grouped" else MERGED[0]).shape[0]
        if experts % ep:
            raise ConfigError(f"parallelism.ep_size {ep}: {name} has {experts} experts, not divisible by ep_size "
                              f"{ep}; choose an ep_size that divides {experts}")
    return found


def split_experts(module: nn.Module, rank: int, ep: int) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """Keep this rank's experts of ``module``; returns ``{name: (old parameter, new one)}``."""
    swapped = {}
    for name, param in list(module.named_parameters(recurse=False)):
        if param.ndim != 3:
            continue
        local = param.shape[0] // ep
        new = nn.Parameter(param.detach()[rank * local:(rank + 1) * local].clone(), requires_grad=param.requires_grad)
        setattr(module, name, new)
        swapped[name] = (param, new)
    return swapped


class ExpertLoad:
    """Rows (token, expert choices) each expert received since the last read, from this rank's tokens."""

    def __init__(self, experts: int):
        self.counts = torch.zeros(experts, dtype=torch.int64)

    def add(self, counts: torch.Tensor) -> None:
        self.counts += counts.detach().to("cpu", torch.int64)


def wrap_forward(module: nn.Module, kind: str, group: Any, ep: int, experts: int) -> ExpertLoad:
    """Route ``module``'s rows through the ep group; returns the module's load counter."""
    load = ExpertLoad(experts)
    inner = module.forward
    if kind == "grouped":
        def forward(x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            load.add(num_tokens_per_expert)
            return dispatch_compute_combine(x, num_tokens_per_expert, inner, group, ep)
    else:
        module.num_experts = experts // ep  # transformers' experts size their one-hot by it

        def local_merged(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            index = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts.to(rows.device))
            return inner(rows, index[:, None], rows.new_ones(rows.shape[0], 1))

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
            slots = top_k_index.reshape(-1)
            order = torch.argsort(slots, stable=True)
            counts = torch.bincount(slots, minlength=experts)
            load.add(counts)
            token = order // top_k_index.shape[1]
            out = dispatch_compute_combine(hidden_states[token], counts, local_merged, group, ep)
            out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
            return torch.zeros_like(hidden_states).index_add_(0, token, out.to(hidden_states.dtype))
    module.forward = forward
    return load
