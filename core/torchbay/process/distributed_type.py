"""Accelerate's ``DistributedType`` enum and which member a run has: from the selected strategy and device
(:func:`distributed_type_for`), never from a list of backends in the core."""

from __future__ import annotations

import enum
import functools
import importlib.resources
import json
from typing import Any


@functools.lru_cache(maxsize=None)
def distributed_type_names() -> list[str]:
    """Accelerate's ``DistributedType`` member names (``resources/distributed_types.json``)."""
    text = importlib.resources.files("torchbay").joinpath("resources/distributed_types.json").read_text("utf-8")
    return json.loads(text)["members"]


DistributedType = enum.Enum("DistributedType", [(n, n) for n in distributed_type_names()],
                            type=str, module=__name__)
DistributedType.__doc__ = "Accelerate's kinds of run; ``accelerator.distributed_type`` is one of them."
DistributedType.__str__ = lambda self: self.value  # type: ignore[method-assign]


def distributed_type_for(strategy: Any, device_backend: Any) -> DistributedType:
    """The ``DistributedType`` member that describes a run of ``strategy`` on ``device_backend``."""
    members = DistributedType.__members__
    explicit = getattr(strategy, "accelerate_distributed_type", None)
    if explicit in members:
        return DistributedType[explicit]
    multi = getattr(device_backend, "accelerate_distributed_type", None) or f"MULTI_{device_backend.name.upper()}"
    if strategy.name in ("single", "ddp"):
        if strategy.world_size <= 1:
            return DistributedType.NO
        return DistributedType[multi] if multi in members else DistributedType.MULTI_CPU
    own = strategy.name.upper()
    if own in members:
        return DistributedType[own]
    return DistributedType[multi] if strategy.world_size > 1 and multi in members else DistributedType.NO
