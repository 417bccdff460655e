"""Expert parallelism (``parallelism.ep_size``) for ``strategy: fsdp``.

ep is not a mesh dimension of its own: it splits the ``dp_shard`` ranks, as torchtitan does. Those ranks read
different batches as before; each holds ``E / ep`` of every expert module's experts (:mod:`.modules`), tokens
travel to their expert's rank and back by all-to-all (:mod:`.dispatch`), and the experts a rank holds are
sharded by FSDP2 over the ``dp_shard / ep`` ranks that hold the same experts (the expert mesh,
``(dp_shard_mod_ep, ep)``), with their gradients divided by ``dp_shard`` like every other weight's. Everything
else (attention, router, norms, embeddings) is sharded over ``dp_shard`` as without ep.

With ``dp_replicate`` (HSDP) the expert mesh is ``(dp_replicate, dp_shard_mod_ep, ep)`` over the same ranks as the
main mesh's ``(dp_replicate, dp_shard)`` (rank ``r * dp_shard + s``): an ep group is consecutive dp_shard ranks of
one replica, and the experts are HSDP'd over ``(dp_replicate, dp_shard_mod_ep)`` (:func:`shard_experts`), their
gradients divided by ``dp_replicate x dp_shard`` (every rank that read tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchbay_fsdp.experts.modules import find_experts, kind_of, split_experts, wrap_forward

__all__ = ["apply_expert_parallel", "expert_mesh", "gather_experts", "shard_experts", "tokens_per_expert"]

#: the attribute of a model holding its expert modules' load counters (name -> ExpertLoad)
LOAD_ATTRIBUTE = "_torchbay_expert_load"
#: the attribute of a model holding the names of its split expert weights
WEIGHTS_ATTRIBUTE = "_torchbay_expert_weights"


def expert_mesh(device_type: str, dp_replicate: int, dp_shard: int, ep: int):
    """``(dp_shard_mod_ep, ep)`` over the dp_shard ranks, ep innermost; with ``dp_replicate`` > 1,
    ``(dp_replicate, dp_shard_mod_ep, ep)`` over all of them (every process calls it)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(dp_replicate * dp_shard).reshape(dp_replicate, dp_shard // ep, ep)
    if dp_replicate == 1:
        return DeviceMesh(device_type, ranks[0], mesh_dim_names=("dp_shard_mod_ep", "ep"))
    return DeviceMesh(device_type, ranks, mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep"))


def shard_experts(modules: list[nn.Module], mesh: Any, mp_policy: Any, reshard_after_forward: Any) -> None:
    """FSDP2 on each expert module (before the blocks and the root, which then leave them alone) over the expert
    data-parallel ranks: ``dp_shard_mod_ep``, or ``(dp_replicate, dp_shard_mod_ep)`` (HSDP). Their gradients are
    summed over those ranks and divided by the number of data-parallel ranks (``mesh.size()``: every rank reads its
    own tokens), as the rest's are.

    gloo has no ``PREMUL_SUM``, which FSDP2 uses for a custom divide factor over a reduce-scatter of several ranks:
    there, a sum then a division (force-sum). Over one rank FSDP2 skips the reduce-scatter and divides its copy by the
    factor itself, then all-reduces any replicas with SUM: force-sum would divide a second time (0.75 for 1.5
    measured at dp_replicate 2 x one shard), so it stays off."""
    from torch.distributed.fsdp import fully_shard

    dims = [name for name in ("dp_replicate", "dp_shard_mod_ep") if name in mesh.mesh_dim_names]
    shard_ranks = mesh.size(mesh.mesh_dim_names.index("dp_shard_mod_ep"))
    for module in modules:
        fully_shard(module, mesh=mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]], mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward)
        module.set_gradient_divide_factor(float(mesh.size()))
        if shard_ranks > 1:
            module.set_force_sum_reduction_for_comms(True)


def apply_expert_parallel(model: nn.Module, plan: list[str] | None, group: Any, rank: int, ep: int
                          ) -> tuple[dict[str, nn.Module], list[tuple[nn.Module, str, nn.Parameter]]]:
    """Keep this ep rank's experts and route tokens through the ep group; returns the expert modules by name and
    ``(module, parameter name, original parameter)`` of each split weight."""
    found = find_experts(model, plan, ep)
    pairs, loads, names = [], {}, set()
    for name, module in found.items():
        kind = kind_of(module)
        experts = next(p for p in module.parameters(recurse=False) if p.ndim == 3).shape[0]
        for pname, (old, _) in split_experts(module, rank, ep).items():
            pairs.append((module, pname, old))
            names.add(f"{name}.{pname}")
        loads[name] = wrap_forward(module, kind, group, ep, experts)
    setattr(model, LOAD_ATTRIBUTE, loads)
    setattr(model, WEIGHTS_ATTRIBUTE, names)
    return found, pairs


def gather_experts(state: dict[str, torch.Tensor], names: set[str], group: Any) -> dict[str, torch.Tensor]:
    """``state`` (whole tensors on every rank) with each split expert weight gathered over the ep group, so that
    it holds every expert again, under its original name (every rank of the group must call it)."""
    out = dict(state)
    size = dist.get_world_size(group)
    for name in sorted(names & set(state)):  # the same order on every rank
        local = state[name].contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        out[name] = torch.cat(parts)
    return out


def tokens_per_expert(model: nn.Module, reset: bool = True) -> dict[str, int]:
    """Rows each expert received since the last call, over every process (call it on every process):
    ``{"<module>/expert_<i>": count}``, ready for ``accelerator.log``. ``reset``: start counting again."""
    model = getattr(model, "module", model)
    loads = getattr(model, LOAD_ATTRIBUTE, None) or {}
    out: dict[str, int] = {}
    for name, load in loads.items():
        counts = load.counts.clone()
        if dist.is_initialized():
            dist.all_reduce(counts)
        out.update({f"{name}/expert_{i}": int(c) for i, c in enumerate(counts)})
        if reset:
            load.counts.zero_()
    return out
