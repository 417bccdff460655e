"""Which stages a rank holds, and the torch.distributed.pipelining schedule that runs them.

Stage placement follows torch's schedules: one stage per rank (GPipe, 1F1B), looped
(Interleaved1F1B, InterleavedZeroBubble: rank r holds stages r, r + pp, r + 2 pp ...) or V
(ZBVZeroBubble: rank r holds stages r and 2 pp - 1 - r).
"""

from __future__ import annotations

from typing import Any, Callable

from torchbay.plugin import SCHEDULES, default_microbatches, virtual_stages


def stage_indices(schedule: str, pp_rank: int, pp_size: int, virtual: int | None) -> list[int]:
    """The (global) indices of the stages rank ``pp_rank`` of the pipeline holds, in order."""
    info = SCHEDULES[schedule]
    v = virtual_stages(schedule, virtual)
    if info.style == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(v)]


def microbatches(section: Any) -> int:
    return section.pp_microbatches or default_microbatches(section.pp_size, section.pp_schedule,
                                                           section.pp_virtual_stages)


def theoretical_bubble(schedule: str, pp_size: int, microbatches: int, virtual: int | None = None) -> float:
    """The idle fraction of a step in the usual cost model (forward = backward = 1 unit per stage; the
    zero-bubble schedules' weight-gradient steps fill most of what remains): (p - 1) / (m + p - 1) for GPipe
    and 1F1B, (p - 1) / (v m + p - 1) interleaved, and about a third of the interleaved bubble for zero bubble."""
    p, m, v = pp_size, microbatches, virtual_stages(schedule, virtual)
    if p == 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    bubble = (p - 1) / (v * m + p - 1)
    return bubble / 3 if "ZeroBubble" in schedule else bubble


def build_schedule(schedule: str, stages: list, n_microbatches: int, loss_fn: Callable):
    """torch's schedule object for this rank's ``stages`` (``PipelineStage`` objects). Gradients are not
    scaled by the schedule (``scale_grads=False``: it would also divide what earlier steps of a gradient
    accumulation window left); the loss function divides each micro-batch's loss instead."""
    import torch.distributed.pipelining.schedules as schedules

    cls = getattr(schedules, SCHEDULES[schedule].torch_class)
    if SCHEDULES[schedule].multi:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def build_eval_schedule(schedule: str, pp_size: int, virtual: int | None, stages: list, n_microbatches: int,
                        loss_fn: Callable):
    """A forward-only schedule for the several-stages-per-rank schedules (torch's zero-bubble schedules cannot
    run ``eval``): each rank runs its stages in stage order, every micro-batch of one before the next, written
    as torch's compute-only schedule actions and lowered (send/recv added) by torch's own runtime; ``None``
    for one stage per rank (the schedule's own ``eval`` serves)."""
    if not SCHEDULES[schedule].multi:
        return None
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    runtime = torch_schedules._PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                                       scale_grads=False)
    placement = {rank: sorted(stage_indices(schedule, rank, pp_size, virtual)) for rank in range(pp_size)}
    to_rank = {stage: rank for rank, held in placement.items() for stage in held}
    runtime.stage_index_to_group_rank = to_rank  # torch's validation wants backward actions: set as it would
    for stage in stages:
        stage.stage_index_to_group_rank = to_rank
    actions = {rank: torch_schedules._add_unshard_reshard(
        [_Action(stage, _ComputationType.FORWARD, mb) for stage in held for mb in range(n_microbatches)])
        for rank, held in placement.items()}
    runtime.pipeline_order_with_comms = torch_schedules._add_send_recv(
        actions, stage_to_rank=lambda s: to_rank[s], num_stages=len(to_rank))
    return runtime
