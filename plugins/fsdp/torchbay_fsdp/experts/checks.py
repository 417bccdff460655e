"""Expert-parallel checks of the ``parallelism`` section (no process group).

ep takes its ranks from ``dp_shard`` and composes with ``dp_replicate`` (HSDP: each replica splits its dp_shard ranks
the same way); ``cp``, ``sp`` and ``tp`` with ep are refused.
"""

from __future__ import annotations

from typing import Any

WHERE = "parallelism"


def check_expert_parallel(section: Any, sizes: dict[str, int]) -> list[str]:
    ep = getattr(section, "ep_size", 1) or 1
    plan = getattr(section, "ep_plan", None)
    if ep == 1:
        return [f"{WHERE}.ep_plan is set but {WHERE}.ep_size is 1; set ep_size or remove ep_plan"] if plan else []
    problems = []
    if sizes["dp_shard"] % ep:
        problems.append(f"{WHERE}.ep_size {ep} must divide dp_shard_size {sizes['dp_shard']}: experts are split over "
                        f"ep ranks taken from the dp_shard ranks; set dp_shard_size to a multiple of {ep}")
    others = [f"{name}_size {sizes[name]}" for name in ("cp", "sp", "tp") if sizes[name] > 1]
    if others:
        problems.append(f"{WHERE}.ep_size {ep} with {', '.join(others)} is not supported yet (ep composes with "
                        f"dp_shard and dp_replicate); set those sizes to 1, or ep_size 1")
    return problems
