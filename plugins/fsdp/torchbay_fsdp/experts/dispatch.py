"""Token dispatch and combine for expert parallelism: all-to-all over the ep group.

Each rank holds ``E / ep`` consecutive experts (rank ``r``: experts ``r*E/ep`` to ``(r+1)*E/ep - 1``). Tokens
arrive sorted by expert with a count per (global) expert; :func:`dispatch_compute_combine` sends each to the rank
holding its expert, runs that rank's experts on what it received (grouped by local expert), and sends the results
back in the original order. Both all-to-alls are differentiable (backward runs the reverse exchange).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


class _AllToAllV(torch.autograd.Function):
    """Rows ``[sum(send[:i]), sum(send[:i+1]))`` go to rank ``i``; ``recv[i]`` rows come from rank ``i``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def dispatch_compute_combine(x: torch.Tensor, counts: torch.Tensor, compute: Callable[[torch.Tensor, torch.Tensor],
                             torch.Tensor], group: Any, ep: int) -> torch.Tensor:
    """``x``: ``(N, H)`` rows sorted by expert; ``counts``: ``(E,)`` rows per expert. ``compute(rows, local_counts)``
    runs this rank's experts on rows grouped by local expert. Returns ``(N, H_out)`` in ``x``'s order."""
    local = counts.numel() // ep
    counts = counts.to(torch.int64)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # received[s*local + e]: rows of rank s for my expert e
    send = counts.view(ep, local).sum(1).tolist()
    recv_by_source = received.view(ep, local)
    recv = recv_by_source.sum(1).tolist()
    rows = _AllToAllV.apply(x, send, recv, group)  # ordered by source rank, then by local expert
    # regroup by local expert (then source): a stable sort of each row's local expert
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep),
                                            recv_by_source.reshape(-1).to(x.device))
    order = torch.argsort(expert_of_row, stable=True)
    out = compute(rows[order], recv_by_source.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAllV.apply(out[back], recv, send, group)
