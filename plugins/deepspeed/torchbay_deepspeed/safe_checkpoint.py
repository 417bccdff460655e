"""DeepSpeed's checkpoint files read without running code from them.

DeepSpeed reads its ``*_model_states.pt`` / ``*_optim_states.pt`` with
torch.load with weights_only off. torchbay gives each engine a checkpoint-engine ``load``
that uses torchbay's safe loader with the few DeepSpeed classes those files hold (plain
data: an enum, a namedtuple, the loss scaler's attributes), and checks every file of a
checkpoint the same way before DeepSpeed's own universal-checkpoint converter reads it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torchbay.plugin import safe_torch_load

#: module.Class names DeepSpeed writes into its checkpoints; rebuilt from attributes only
DEEPSPEED_CHECKPOINT_CLASSES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def allowed_classes() -> list[Any]:
    classes = []
    for dotted in DEEPSPEED_CHECKPOINT_CLASSES:
        module, _, name = dotted.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed release: that class is simply not allowed
            continue
    return classes


def load_file(path: str | Path, trusted: bool, map_location: Any = "cpu") -> Any:
    return safe_torch_load(path, "DeepSpeed checkpoint", allowed=allowed_classes(), trusted=trusted,
                           map_location=map_location if map_location is not None else "cpu")


def install_safe_loader(engine, trusted: bool) -> None:
    """Make ``engine`` read its checkpoint files through :func:`load_file`."""
    checkpoint_engine = engine.checkpoint_engine
    if checkpoint_engine is None:  # an engine without one (ZeRO-3 without optimizer) loads no checkpoint at all
        return

    def load(path, map_location=None):
        return load_file(path, trusted, map_location)

    checkpoint_engine.load = load


def check_every_file(folder: Path, trusted: bool) -> None:
    """Read every ``.pt`` under ``folder`` safely (before a tool that unpickles freely touches it)."""
    for path in sorted(folder.rglob("*.pt")):
        load_file(path, trusted)
