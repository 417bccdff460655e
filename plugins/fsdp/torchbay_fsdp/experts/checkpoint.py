"""Sharded (DCP) checkpoints of split experts: every expert weight saved whole, in its original name, resharded on load.

Under expert parallel (:mod:`torchbay_fsdp.experts`) each ep rank keeps ``E / ep`` experts of every 3-D expert weight
under the weight's original name, and FSDP2 shards them (``Shard(0)``) over the ``dp_shard_mod_ep`` ranks that hold
the same experts: a DTensor of shape ``(E / ep, ...)`` on that 1-D mesh. Handed to DCP as they are, the ep ranks would
each claim the whole ``(E / ep, ...)`` tensor of that name, and DCP would keep one rank's experts.

So, in the state dicts handed to DCP (the model's, and the optimizer's ``exp_avg``... of the same names from
``get_optimizer_state_dict``), each such tensor is said for what it is: this rank's piece of the whole ``(E, ...)``
weight, a DTensor on a 2-D mesh ``(ep, dp_shard_mod_ep)`` over the same ranks with placements
``(Shard(0), Shard(0))``. DTensor shards left to right: the experts in ``ep`` chunks first (ep rank ``r`` holds
experts ``r*E/ep`` to ``(r+1)*E/ep - 1``, as the split does), then each chunk over ``dp_shard_mod_ep`` with
``torch.chunk``'s sizes, as FSDP2 shards (an uneven split agrees: FSDP2's local tensor is its unpadded chunk). The
mesh is the expert mesh's rank grid transposed (ep outermost) so that this default order applies (on the expert
mesh itself it would take torch's private ``_StridedShard``). The DTensor is made with ``from_local`` without a
check and shares the local storage: a save reads, and a load writes, the FSDP parameters and optimizer state themselves.

With ``dp_replicate`` (HSDP), FSDP2's expert tensors are ``(Replicate(), Shard(0))`` on the 2-D mesh
``(dp_replicate, dp_shard_mod_ep)``, and the checkpoint mesh gains ``dp_replicate`` outermost:
``(dp_replicate, ep, dp_shard_mod_ep)``, placements ``(Replicate(), Shard(0), Shard(0))`` (DCP writes one replica's
pieces).

DCP then sees one tensor per name, in the original names and shapes, and reshards like any other: a checkpoint
saved at ep 2 x dp_shard 2 loads at ep 1 on one process, or at ep 2 on two, and back; ``torchbay merge-weights``
reads whole experts. On load, once DCP has filled the pieces in place, :func:`fsdp_experts` puts the FSDP tensors
back, so that ``set_model_state_dict`` / ``set_optimizer_state_dict`` get what they expect. The state dicts are
copied, never changed: ``get_optimizer_state_dict`` hands out the optimizer's own per-parameter state.
"""

from __future__ import annotations

from typing import Any

import torch

from torchbay.errors import CheckpointError

__all__ = ["checkpoint_mesh", "fsdp_experts", "whole_experts"]

#: the mesh dimension names of :func:`checkpoint_mesh`, outermost first (``dp_replicate`` only when above 1)
DIMS = ("dp_replicate", "ep", "dp_shard_mod_ep")


def checkpoint_mesh(device_type: str, dp_replicate: int, dp_shard: int, ep: int):
    """``([dp_replicate,] ep, dp_shard_mod_ep)``: the expert mesh's ranks with its two inner dimensions transposed
    (every process calls it, once)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(dp_replicate * dp_shard).reshape(dp_replicate, dp_shard // ep, ep).transpose(1, 2)
    if dp_replicate == 1:
        return DeviceMesh(device_type, ranks[0].contiguous(), mesh_dim_names=DIMS[1:])
    return DeviceMesh(device_type, ranks.contiguous(), mesh_dim_names=DIMS)


def whole_experts(state: dict[str, Any], names: set[str], mesh: Any) -> dict[str, Any]:
    """``state`` (a model state dict, or an optimizer's from ``get_optimizer_state_dict``: per-parameter state under
    ``state["state"][name]``) with each split expert tensor re-expressed as this rank's piece of the whole weight on
    ``mesh`` (:func:`checkpoint_mesh`). A new dict: the containers of ``state`` (the optimizer's own per-parameter
    state among them) are left as they are."""
    view = dict(state)
    for name in sorted(names & set(state)):
        if _is_expert_shard(state[name]):
            view[name] = _whole(state[name], mesh)
    per_param = state.get("state")
    if isinstance(per_param, dict):  # an optimizer's state dict
        view["state"] = dict(per_param)
        for name in sorted(names & set(per_param)):  # exp_avg, exp_avg_sq...; not the scalar "step"
            view["state"][name] = {key: _whole(value, mesh) if _is_expert_shard(value) else value
                                   for key, value in per_param[name].items()}
    return view


def fsdp_experts(loaded: dict[str, Any], state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """``loaded`` (:func:`whole_experts` of ``state``, filled in place by a DCP load: the pieces share the FSDP
    tensors' storage) with ``state``'s FSDP tensors back in the places :func:`whole_experts` changed."""
    out = dict(loaded)
    for name in names & set(state):
        if _is_expert_shard(state[name]):
            out[name] = state[name]
    per_param, loaded_per_param = state.get("state"), loaded.get("state")
    if isinstance(per_param, dict) and isinstance(loaded_per_param, dict):
        out["state"] = dict(loaded_per_param)
        for name in names & set(per_param) & set(loaded_per_param):
            own = per_param[name]
            out["state"][name] = {key: own[key] if _is_expert_shard(own.get(key)) else value
                                  for key, value in loaded_per_param[name].items()}
    return out


def _is_expert_shard(value: Any) -> bool:
    """An FSDP2 expert tensor: ``(Shard(0),)`` on ``dp_shard_mod_ep``, or ``(Replicate(), Shard(0))`` (HSDP)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return isinstance(value, DTensor) and value.ndim == 3 and \
        tuple(value.placements) in ((Shard(0),), (Replicate(), Shard(0)))


def _whole(tensor: Any, mesh: Any) -> Any:
    """``tensor`` (this ep rank's ``(E / ep, ...)`` experts, FSDP2-sharded) as a piece of the whole ``(E, ...)``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = (Replicate(),) * (mesh.ndim - 2) + (Shard(0), Shard(0))
    shape = torch.Size((tensor.shape[0] * mesh.size(mesh.mesh_dim_names.index("ep")), *tensor.shape[1:]))
    local = tensor.to_local()
    expected, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(local.shape) != tuple(expected):  # FSDP2's chunking disagrees with DTensor's: never save a wrong layout
        raise CheckpointError(f"an expert weight's local shard {tuple(local.shape)} is not the piece {expected} of the "
                              f"whole {tuple(shape)} on the {mesh.mesh_dim_names} mesh; save the full model with "
                              f"accelerator.save_model instead, and report this")
    with torch.no_grad():
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())
