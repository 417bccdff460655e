"""The pipeline-parallel settings of ``ParallelismConfig`` (``pp_size`` and its schedule), checked
without torch.distributed: which schedules exist, how many stages each rank holds, and the rules
on micro-batches that torch's schedules enforce only once a process group runs.

Schedules (``pp_schedule``; torch.distributed.pipelining's classes):

========================  =====================================  =====================================
name                      torch class                            stages per rank (``pp_virtual_stages``)
========================  =====================================  =====================================
``GPipe``                 ``ScheduleGPipe``                      1
``1F1B``                  ``Schedule1F1B``                       1 (micro-batches >= pp_size)
``Interleaved1F1B``       ``ScheduleInterleaved1F1B``            2 or more (default 2), looped placement
``InterleavedZeroBubble`` ``ScheduleInterleavedZeroBubble``      2 or more (default 2), looped placement
``ZBVZeroBubble``         ``ScheduleZBVZeroBubble``              exactly 2, V placement
========================  =====================================  =====================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ScheduleInfo:
    torch_class: str
    multi: bool  #: several stages per rank
    style: str = "loop"  #: placement of stage s: "loop" (rank s % pp) or "v" (rank s, then back)
    exact_virtual: Optional[int] = None


SCHEDULES = {
    "GPipe": ScheduleInfo("ScheduleGPipe", False),
    "1F1B": ScheduleInfo("Schedule1F1B", False),
    "Interleaved1F1B": ScheduleInfo("ScheduleInterleaved1F1B", True),
    "InterleavedZeroBubble": ScheduleInfo("ScheduleInterleavedZeroBubble", True),
    "ZBVZeroBubble": ScheduleInfo("ScheduleZBVZeroBubble", True, "v", 2),
}
DEFAULT_SCHEDULE = "1F1B"


def virtual_stages(schedule: str, given: Optional[int]) -> int:
    """Stages per rank: ``given``, else 2 for an interleaved/V schedule and 1 otherwise."""
    info = SCHEDULES.get(schedule)
    if given:
        return given
    return 2 if info is not None and info.multi else 1


def default_microbatches(pp_size: int, schedule: str, virtual: Optional[int]) -> int:
    """As many micro-batches as pipeline stages in all (at least ``pp_size``)."""
    return max(pp_size, pp_size * virtual_stages(schedule, virtual)) if pp_size > 1 else 1


def check_pipeline(pp_size: int, schedule: str, microbatches: Optional[int], virtual: Optional[int],
                   where: str = "parallelism") -> list[str]:
    """Problems with the pipeline settings (empty when ``pp_size`` is 1 and nothing pipeline-only is set)."""
    problems: list[str] = []
    if schedule not in SCHEDULES:
        return [f"{where}.pp_schedule {schedule!r} is not a pipeline schedule; use one of {', '.join(SCHEDULES)}"]
    info = SCHEDULES[schedule]
    if pp_size == 1:
        if microbatches not in (None, 1) or virtual not in (None, 1):
            problems.append(f"{where}.pp_microbatches / pp_virtual_stages are set but {where}.pp_size is 1 (no "
                            f"pipeline); set pp_size > 1 or remove them")
        return problems
    v = virtual_stages(schedule, virtual)
    if v < 1:
        problems.append(f"{where}.pp_virtual_stages {v}: give at least 1")
    elif not info.multi and v != 1:
        problems.append(f"{where}.pp_schedule {schedule} runs one stage per rank but pp_virtual_stages is {v}; use "
                        f"Interleaved1F1B (or InterleavedZeroBubble) for several, or set pp_virtual_stages 1")
    elif info.multi and info.exact_virtual and v != info.exact_virtual:
        problems.append(f"{where}.pp_schedule {schedule} places exactly {info.exact_virtual} stages per rank (a V) "
                        f"but pp_virtual_stages is {v}; set pp_virtual_stages {info.exact_virtual}")
    elif info.multi and v < 2:
        problems.append(f"{where}.pp_schedule {schedule} interleaves several stages per rank but pp_virtual_stages "
                        f"is {v}; set pp_virtual_stages 2 or more, or use 1F1B")
    m = microbatches if microbatches is not None else default_microbatches(pp_size, schedule, virtual)
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        problems.append(f"{where}.pp_microbatches {m!r}: give a whole number of at least 1")
        return problems
    stages = pp_size * v
    if schedule in ("1F1B", "ZBVZeroBubble") and m < stages:
        problems.append(f"{where}.pp_microbatches {m}: schedule {schedule} needs at least as many micro-batches as "
                        f"pipeline stages ({stages}); set pp_microbatches >= {stages}")
    if info.multi and info.style == "loop":
        rounds = max(1, m // pp_size)
        if m % rounds:
            problems.append(f"{where}.pp_microbatches {m}: schedule {schedule} needs a multiple of pp_size "
                            f"({pp_size}) micro-batches (or fewer than pp_size); set pp_microbatches "
                            f"{rounds * pp_size}")
    return problems
