"""Reaching DeepSpeed: its accelerator for a torch device type, importing it with its logging tamed, and what
torchbay keeps about each engine it built (:class:`EngineRecord`); the checkpoint tag every engine saves under."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from torchbay_deepspeed.objects import (
    EngineOptimizer,
    PendingEngine,
)

#: torch device type -> DeepSpeed accelerator name (DS_ACCELERATOR)
DS_ACCELERATORS = {"cpu": "cpu", "cuda": "cuda", "xpu": "xpu", "npu": "npu", "mps": "mps", "hpu": "hpu",
                   "mlu": "mlu", "sdaa": "sdaa"}


CHECKPOINT_TAG = "ds"


def ds_accelerator_env(torch_type: str) -> dict[str, str]:
    name = DS_ACCELERATORS.get(torch_type)
    return {"DS_ACCELERATOR": name} if name else {}


def import_deepspeed(torch_type: str, log_level: str = "warning"):
    """Import deepspeed with its accelerator matching torchbay's device."""
    for key, value in ds_accelerator_env(torch_type).items():
        os.environ.setdefault(key, value)
    import deepspeed

    level = getattr(logging, log_level.upper())
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(level)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(level)
    except Exception:  # pragma: no cover
        pass
    return deepspeed


@dataclass
class EngineRecord:
    """One prepared model and what DeepSpeed built for it."""

    index: int
    module: torch.nn.Module
    engine: Any = None
    optimizer: Optional[EngineOptimizer] = None
    pending: Optional[PendingEngine] = None
    config: dict = field(default_factory=dict)
    report: list = field(default_factory=list)
    param_ids: set = field(default_factory=set)
    has_optimizer: bool = False
    #: ZeRO stage 0 in fp32 keeps no norm: measured here before the step when clipping is on
    measure_norm: bool = False
    last_norm: Optional[float] = None

    @property
    def trains(self) -> bool:
        return self.engine is not None and self.has_optimizer


def _param_ids(obj) -> set:
    if isinstance(obj, torch.nn.Module):
        return {id(p) for p in obj.parameters()}
    return {id(p) for group in obj.param_groups for p in group["params"]}
