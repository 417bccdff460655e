"""The two differentiable collectives of Ulysses on an sp process group: the all-to-all that swaps the sharded
dimension (sequence <-> heads) and the sum over the group that the loss takes."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dimension 0 goes to rank ``i``; the chunk from rank ``i`` lands at ``i``. Its own inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group; backward sums the gradients over the group too (every rank's output is the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOverGroup.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``(B, H, S/sp, D)`` (every head, this rank's slice of the sequence) -> ``(B, H/sp, S, D)`` (this rank's
    heads, the whole sequence)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, size, h // size, s, d).transpose(0, 1)  # (sp, B, H/sp, S/sp, D): chunk i to rank i
    got = _AllToAll.apply(chunks, group)  # got[j]: rank j's slice of the sequence, for this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def sequence_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``(B, S, H/sp, D)`` (attention's output: the whole sequence, this rank's heads) -> ``(B, S/sp, H, D)``."""
    b, s, h, d = x.shape
    chunks = x.reshape(b, size, s // size, h, d).transpose(0, 1)  # (sp, B, S/sp, H/sp, D): slice i to rank i
    got = _AllToAll.apply(chunks, group)  # got[j]: rank j's heads, for this rank's slice of the sequence
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)
