"""Saving in the background (``save_state(blocking=False)``): whether a save may run there, the staging copy, the
writer thread, and finishing the save in flight; the mixin of
:class:`~torchbay.checkpoint.checkpointer.StateCheckpointer` that does it (the handle and the staging buffer are
:mod:`torchbay.checkpoint.async_save`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from torchbay.checkpoint.async_save import AsyncSave, StagingBuffer
from torchbay.errors import CheckpointError
from torchbay.storage import files as ckfiles
from torchbay.storage import publish as ckdir

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.checkpoint.inputs import CheckpointServices, PreparedObjects

log = logging.getLogger("torchbay")


@dataclass
class StateParts:
    """What one save writes: live objects (a synchronous save) or their copies (an asynchronous one)."""

    models: list
    optimizers: list
    owners: list
    rng: Any
    rank_precision: Any
    schedulers: list
    custom: list
    precision: Any
    training_state: Any
    extras: dict
    manifest: dict | None  # the manifest's fields taken at the call (asynchronous saves)
    started: bool = False  # models and optimizers are written by the strategy's start_checkpoint
    finish_started: Any = None  # what start_checkpoint returned: waits, returns this rank's files


def describe_error(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


class BackgroundSaving:
    """The asynchronous half of :class:`~torchbay.checkpoint.checkpointer.StateCheckpointer`: whether a save may run in
    the background, the staging copy, the writer thread, and finishing a save in flight."""

    run: CheckpointServices
    prepared: PreparedObjects

    # -- asynchronous save ------------------------------------------------------------
    def _can_save_in_background(self) -> bool:
        run = self.run
        why = None
        if run.strategy.can_start_checkpoint():
            return True  # the strategy starts its own asynchronous write of models and optimizers
        if not getattr(run.strategy, "async_checkpoint", False):
            why = run.strategy.synchronous_checkpoint_reason()
        elif run.checkpoint_io.collective and run.num_processes > 1:
            why = (f"checkpoint.io '{run.checkpoint_io.name}' writes with collectives, which must not run beside "
                   f"the training loop's")
        if why is not None:
            if why not in self._warned_sync:
                self._warned_sync.add(why)
                log.warning("torchbay: save_state(blocking=False) saves synchronously here: %s", why)
            return False
        return True

    def _staging(self) -> StagingBuffer:
        if self._stage is None:
            self._stage = StagingBuffer(pin_memory=bool(getattr(self.run.device_backend, "pinned_staging", False)))
        return self._stage

    def _save_in_background(self, final: Path, partial: Path, discard: Callable[[], None]) -> AsyncSave:
        run = self.run
        stage = self._staging()

        def capture(started: bool) -> StateParts:
            stage.begin()
            parts = self._capture(stage, without_models=started)
            stage.finish(run.device_backend.synchronize)
            return parts

        started = run.strategy.can_start_checkpoint()
        parts = self.on_every_rank("save_state", lambda: capture(started), cleanup=discard)  # the state at the call
        if started:  # models and optimizers: the strategy's own asynchronous write (its own process group)
            parts.finish_started = self.on_every_rank("save_state", lambda: run.strategy.start_checkpoint(
                partial, self.prepared.models, self.prepared.optimizers, run.checkpoint_io, owners=parts.owners),
                cleanup=discard)
        single = run.num_processes == 1 and not started
        handle = AsyncSave(final, self._finish_background)
        handle.publishes_itself = single
        handle.finish_started = parts.finish_started
        handle.discard_unpublished = discard
        handle.manifest = parts.manifest

        def work() -> None:
            try:
                handle.local_records = self._write_recorded(partial, parts)
                if single:  # nothing to agree on: the writer publishes (same code as a synchronous save)
                    self._publish(final, partial, [handle.local_records], parts.manifest)
                    handle.mark_published()
            except BaseException:
                if single:
                    with contextlib.suppress(Exception):
                        discard()
                raise

        self._pending = handle
        handle.start(work, nice=run.config.checkpoint.async_writer_nice)
        return handle

    def _finish_background(self, handle: AsyncSave) -> None:
        """Main thread of every rank: wait for the writer, agree, publish (several processes)."""
        if self._pending is handle:
            self._pending = None
        handle.join()
        if handle.publishes_itself:
            if handle.error is not None and not isinstance(handle.error, CheckpointError):
                handle.error = CheckpointError(f"save_state to {handle.path} failed: {describe_error(handle.error)}")
        else:
            partial, _ = ckdir.siblings(handle.path)

            def written() -> dict:
                records = {}
                if handle.finish_started is not None:  # the strategy's own writes end first
                    records.update(ckfiles.record_files(partial, handle.finish_started()))
                if handle.error is not None:
                    raise handle.error
                return {**handle.local_records, **records}

            try:
                records_per_rank = self.on_every_rank("save_state", written, cleanup=handle.discard_unpublished,
                                                      share=True)
                manifest = handle.manifest if self.run.is_main_process else None
                self.main_only("save_state", lambda: self._publish(handle.path, partial, records_per_rank, manifest),
                                cleanup=handle.discard_unpublished)
                handle.mark_published()
                handle.error = None
            except CheckpointError as exc:
                handle.error = exc
        if handle.error is None:
            self._after_publish(handle.path)

    def finish_pending(self) -> None:
        """Finish the save in flight, if any (every rank calls it at the same point); its error is raised."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.wait()

    def end(self) -> None:
        """At ``end_training``: finish the save in flight, free the staging memory and wait for the removal of the
        checkpoints the saves replaced, so that no file of torchbay's changes afterwards."""
        self.finish_pending()
        self._stage = None
        self.run.strategy.release_checkpoint_staging()  # what a strategy's own start_checkpoint kept
        ckdir.wait_for_removals()
