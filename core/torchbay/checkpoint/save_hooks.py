"""What a save-state pre-hook (``Accelerator.register_save_state_pre_hook``) may do to a checkpoint.

The hooks run on every rank once the checkpoint's directory is open (``<output_dir>.partial``, published as
``output_dir`` with the rest), before anything else is written. Files they write there become part of the
checkpoint: listed in its manifest with their checksums, verified on load, removed with it by ``total_limit``.
A model whose weights they take out of the ``weights`` list (they saved it themselves, as diffusers' training
scripts do) is left out of the checkpoint; the matching load-state pre-hook takes it out of its ``models`` list.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.checkpoint.inputs import CheckpointServices, PreparedObjects

#: ``before_write(directory)``: run the hooks; the indices of the models still to save (``None``: every one)
BeforeWrite = Callable[[Path], "list[int] | None"]


def _files_in(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() or p.is_symlink()}


class SaveHookSupport:
    """Mixin of :class:`~torchbay.checkpoint.checkpointer.StateCheckpointer`."""

    run: CheckpointServices
    prepared: PreparedObjects

    def run_before_write(self, partial: Path, before_write: BeforeWrite,
                         discard: Callable[[], None]) -> tuple[list[str], list[int] | None]:
        """Run ``before_write`` on every rank: (the files it added, read on the main process; the models to save,
        as the main process decided, which alone saves models' weights)."""
        before = self.main_only("save_state", lambda: _files_in(partial), cleanup=discard)
        kept = self.on_every_rank("save_state", lambda: before_write(partial), cleanup=discard, share=True)[0]
        added = self.main_only("save_state", lambda: sorted(_files_in(partial) - before), cleanup=discard)
        return added, kept

    @contextlib.contextmanager
    def only_models(self, kept: list[int] | None) -> Iterator[None]:
        """Inside the block, the checkpoint holds only the models ``kept`` (all of them for ``None``)."""
        if kept is None:
            yield
            return
        every = self.prepared.models
        self.prepared.models = [every[i] for i in kept]
        try:
            yield
        finally:
            self.prepared.models = every


def kept_after_hooks(hooks: list[Callable[..., Any]], models: list[Any], weights: list[Any],
                     directory: Path) -> list[int] | None:
    """Call each save hook as Accelerate does (``hook(models, weights, output_dir)``); the indices of the models
    whose weights are still in the list afterwards (``None`` when it was not changed)."""
    given = list(weights)
    for hook in hooks:
        hook(list(models), weights, str(directory))
    if len(weights) == len(given) and all(a is b for a, b in zip(weights, given)):
        return None
    ids = [id(w) for w in weights]
    return [i for i, w in enumerate(given) if id(w) in ids]
