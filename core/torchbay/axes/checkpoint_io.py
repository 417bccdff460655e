"""The checkpoint-io axis: how one state dict of tensors reaches storage and comes back.

The strategy decides *what* a checkpoint holds; the selected :class:`CheckpointIO`
(``checkpoint.io``) decides *how* its tensors are written and read. Built-in
implementations (safetensors shards, torch DCP) are in :mod:`torchbay.builtin.checkpoint_io`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch


class CheckpointIO:
    """Writes and reads one state dict of tensors under a file stem in a directory.

    ``collective``: every rank calls :meth:`save_state_dict` and :meth:`load_state_dict`
    (each writes its own part, as torch DCP does); otherwise only the main process saves.
    ``trusted`` is ``checkpoint.allow_unsafe_pickle`` (set by the accelerator).
    """

    name: ClassVar[str] = ""
    collective: ClassVar[bool] = False
    trusted: bool = False

    def __init__(self, max_shard_size: str = "5GB"):
        self.max_shard_size = max_shard_size

    def save_state_dict(self, state: dict[str, torch.Tensor], directory: Path, stem: str) -> list[str]:
        """Write ``state``; return the file names written (relative to ``directory``)."""
        raise NotImplementedError

    def load_state_dict(self, directory: Path, stem: str, device: str = "cpu",
                        template: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Read ``stem``; an io may load in place into ``template`` (the model's own state, from
        ``state_dict()``) and return it, instead of a second copy of the weights."""
        raise NotImplementedError

    def in_place_reads(self, directory: Path, stem: str, template: dict[str, torch.Tensor]) -> list | None:
        """The reads (:class:`torchbay.storage.inplace.Read`) that restore ``stem`` into the
        tensors of ``template`` (a module's ``state_dict()``), planned without changing anything;
        ``None`` when this io cannot (``load_state_dict`` is used). torchbay plans them beside
        the checksum verification and runs them once the files are verified."""
        return None

    def exists(self, directory: Path, stem: str) -> bool:
        raise NotImplementedError
