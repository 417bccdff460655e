"""The files of a sharded fsdp checkpoint: one DCP folder per model and per optimizer, and the info file beside
them. :mod:`torchbay_fsdp.checkpoint` writes them, :mod:`torchbay_fsdp.merge` reads them (offline, no strategy)."""

from __future__ import annotations

#: the file save_checkpoint writes next to the sharded state (read by ``torchbay merge-weights``)
INFO_FILE = "fsdp_checkpoint.json"


def model_dir(i: int) -> str:
    return f"fsdp_model_{i}"


def optimizer_dir(i: int) -> str:
    return f"fsdp_optimizer_{i}"
