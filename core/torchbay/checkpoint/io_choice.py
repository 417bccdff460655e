"""Which checkpoint io writes and reads one checkpoint's model weights.

``checkpoint.io`` chooses it for the run; ``save_state(safe_serialization=False)`` chooses torch's pickle format
(``<stem>.bin``, as Accelerate writes ``pytorch_model.bin``) for that one save. The manifest names the io that wrote
the weights, and ``load_state`` reads them with that io, whatever the run's ``checkpoint.io`` is now.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator

from torchbay.errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.checkpoint_io import CheckpointIO
    from torchbay.checkpoint.inputs import CheckpointServices

#: the io of ``save_state(safe_serialization=False)`` (torchbay.builtin.checkpoint_io.TorchCheckpointIO)
PICKLE_IO = "torch"


class CheckpointIOChoice:
    """Mixin of :class:`~torchbay.checkpoint.checkpointer.StateCheckpointer`: the io of one save or load."""

    run: CheckpointServices
    io_overridden = False  # inside using_io: saves are written at once (a background write would read self.run)

    def io_named(self, name: str | None) -> CheckpointIO:
        """The run's io, or a fresh one of the registered io ``name`` with the run's settings."""
        current = self.run.checkpoint_io
        if name is None or name == current.name:
            return current
        registered = self.run.pm.registries()["checkpoint_io"]
        if name not in registered:
            raise CheckpointError(f"the checkpoint's model weights were written by checkpoint io '{name}', which is "
                                  f"not installed here; install the plugin that provides it")
        io = registered[name](max_shard_size=current.max_shard_size)
        io.trusted = current.trusted
        return io

    @contextlib.contextmanager
    def using_io(self, io: CheckpointIO) -> Iterator[None]:
        """Inside the block, the checkpoint's weights are written and read with ``io`` (blocking work only: a
        background save reads the io when it writes)."""
        saved = self.run
        if io is saved.checkpoint_io:
            yield
            return
        self.run = dataclasses.replace(saved, checkpoint_io=io)
        self.io_overridden = True
        try:
            yield
        finally:
            self.run = saved
            self.io_overridden = False
