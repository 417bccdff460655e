"""Seeding every generator a run draws from, and giving every process the main process's generator state
(Accelerate's ``set_seed``, ``synchronize_rng_state(s)``)."""

from __future__ import annotations

import os
import random as _random
from typing import Any

import numpy as np
import torch

from torchbay.errors import TorchbayError
from torchbay.process import running
from torchbay.process.current import current


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy, torch and every accelerator torch knows."""
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    _random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds the current accelerator's generators
    for backend in running.live_device_backends():  # devices whose generators torch.manual_seed does not reach
        backend.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: Any = None, generator: torch.Generator | None = None) -> None:
    """Give every process the main process's state of one generator.

    ``rng_type``: ``"torch"`` (the CPU generator), ``"generator"`` (``generator``), or a device
    name (that device's default generators, through its device plugin).
    """
    strategy = current().strategy
    kind = getattr(rng_type, "value", rng_type) or "torch"
    if strategy.world_size <= 1:
        return
    if kind == "torch":
        torch.set_rng_state(strategy.broadcast_object(torch.get_rng_state()))
    elif kind == "generator":
        if generator is None:
            raise TorchbayError("synchronize_rng_states(['generator']) needs generator=")
        generator.set_state(strategy.broadcast_object(generator.get_state()))
    else:
        backend = strategy.device_backend
        if kind != backend.name:
            return  # a device this run does not use: nothing to synchronise (as Accelerate skips it)
        backend.set_rng_state(strategy.broadcast_object(backend.get_rng_state()))


def synchronize_rng_states(rng_types: list[Any], generator: torch.Generator | None = None) -> None:
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
