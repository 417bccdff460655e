"""Small helpers with Accelerate's names: ``set_seed``, ``get_logger``, ``tqdm``."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy, torch and every accelerator torch knows."""
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds the current accelerator's generators
    from torchbay.accelerator import live_device_backends

    for backend in live_device_backends():  # devices whose generators torch.manual_seed does not reach
        backend.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _is_main(local: bool) -> bool:
    return int(os.environ.get("LOCAL_RANK" if local else "RANK", "0")) == 0


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logs on the main process only, unless ``main_process_only=False`` is passed."""

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False, **kwargs):
        if self.isEnabledFor(level) and (not main_process_only or _is_main(local=False)):
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    logger = logging.getLogger(name)
    level = log_level or os.environ.get("TORCHBAY_LOG_LEVEL")
    if level:
        logger.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any):
    """``tqdm.auto.tqdm``, disabled on every process but the local main one by default."""
    from tqdm.auto import tqdm as _tqdm

    if main_process_only:
        kwargs["disable"] = kwargs.get("disable", False) or not _is_main(local=True)
    return _tqdm(*args, **kwargs)
