"""The FSDP strategy's asynchronous checkpoint (``save_state(blocking=False)``), FSDP1 and FSDP2 alike.

In the call, on the main thread of every rank: each model's and optimizer's sharded state dict
(``get_model_state_dict`` / ``get_optimizer_state_dict``: FSDP2's DTensors, FSDP1's ShardedTensors)
is copied into host memory kept from one save to the next (:class:`HostStaging`: a core
:class:`~torchbay.checkpoint.async_save.StagingBuffer` per state, page-locked where the device backend
pins staging memory); the ranks then agree that every one of them holds its copy. Only then does
each rank start one thread per model and optimizer that writes its copy with
``torch.distributed.checkpoint.save`` (what ``dcp.async_save`` runs in its own thread), its
collectives on a gloo group of that save's own, never the training loop's.

The staging memory is reused only once the writes from it are over: torchbay finishes a save in
flight before the next one starts (``save_state`` waits for it first), and a write still running
anyway (its finish lost to an error) keeps its memory: the next save stages into new memory.

Why not ``dcp.async_save`` itself: its staging copy (torch >= 2.9) refuses FSDP1's ShardedTensors
(``torch function 'data_ptr' ... not supported for ShardedTensor``); and it stages and starts in
one call, so a rank whose state could not be taken would leave the others' writes waiting forever
in their first collective for a rank that never starts (and the next save on that group would
meet those stale collectives). Copying first, agreeing, then starting leaves no write behind.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from torchbay.errors import CheckpointError
from torchbay.plugin import StagingBuffer, dcp_files_of_rank


class ShardStaging(StagingBuffer):
    """Core's staging buffer, for sharded state too: a DTensor's local shard, or each local shard of a
    ShardedTensor, is copied into the buffer kept for its path (same shape and dtype: reused); the copy
    keeps the DTensor's mesh and placements, the ShardedTensor's metadata (its placements say cpu, as
    ``ShardedTensor.to("cpu")`` writes them)."""

    def _tensor(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            local = super()._tensor(tensor.to_local(), f"{path}:local")
            return DTensor(local, tensor._spec, requires_grad=False)  # what DTensor.to("cpu") keeps: the spec
        if isinstance(tensor, ShardedTensor):
            cpu = torch.device("cpu")
            shards = []
            for i, shard in enumerate(tensor.local_shards()):
                metadata = copy.deepcopy(shard.metadata)
                if metadata.placement is not None:
                    metadata.placement._device = cpu
                shards.append(Shard(super()._tensor(shard.tensor, f"{path}:shard{i}"), metadata))
            global_metadata = copy.deepcopy(tensor.metadata())
            for metadata in global_metadata.shards_metadata:
                metadata.placement._device = cpu  # type: ignore[union-attr]
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, sharded_tensor_metadata=global_metadata, process_group=tensor._process_group,
                init_rrefs=tensor._init_rrefs)
        return super()._tensor(tensor, path)


class HostStaging:
    """The host memory FSDP's asynchronous saves stage into: one :class:`ShardStaging` per state (its
    stem: ``fsdp_model_0``...), kept from one save to the next, and the writes of the last save."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self.buffers: dict[str, ShardStaging] = {}
        self.writes: list[Future] = []  # the last save's writer threads, which read from the buffers

    def in_use(self) -> bool:
        """Whether a write from these buffers may still be running (then they must not be written to)."""
        return any(not future.done() for future in self.writes)

    def buffer(self, stem: str) -> ShardStaging:
        if stem not in self.buffers:
            self.buffers[stem] = ShardStaging(self.pin_memory)
        return self.buffers[stem]

    def nbytes(self) -> int:
        return sum(buffer.nbytes() for buffer in self.buffers.values())

    def data_ptrs(self) -> dict[str, int]:
        """Where each kept buffer's memory starts, by stem and path (a save that reuses them leaves these alike)."""
        return {f"{stem}{path}": t.data_ptr() for stem, buffer in self.buffers.items()
                for path, t in buffer._buffers.items()}


class AgreedStart:
    """The writes of one asynchronous save, started once every rank staged its state.

    ``stage(stem, take)`` runs ``take()`` (the state dict) and copies it into ``staging``; then the
    ranks agree (``all_gather_object`` on the training loop's group, on the main thread: every rank
    calls ``save_state`` at the same point) that every one of them did, before any rank goes on to the
    next state dict (FSDP1's optimizer state dict is itself collective: a rank that skipped it
    would leave the others waiting in it). Once a rank failed, no rank stages more or starts a
    write: :meth:`start` raises the error on the failing rank and returns a ``finish`` that wrote
    nothing on the others; the caller's own agreement (torchbay's ``save_state``) then raises on
    every rank, naming the failing one.
    """

    def __init__(self, strategy: Any, directory: Path, staging: HostStaging):
        self.strategy = strategy
        self.directory = directory
        self.staging = staging
        self.staged: list[tuple[str, Any]] = []
        self.error: BaseException | None = None
        self.failed: list[int] = []  # the ranks that could not take their state

    def stage(self, stem: str, take: Callable[[], Any]) -> None:
        if self.failed:
            return
        try:
            state = take()
            buffer = self.staging.buffer(stem)
            buffer.begin()
            copied = buffer.copy(state, stem)
            buffer.finish(self.strategy.device_backend.synchronize)  # copies from the device are over
            self.staged.append((stem, copied))
        except Exception as exc:
            self.error = exc
        message = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        self.failed = [rank for rank, m in enumerate(self.strategy.all_gather_object(message)) if m]

    def start(self, group: Callable[[str], Any], after: Callable[[], list[str]]) -> Callable[[], list[str]]:
        """One writer thread per staged state, if every rank staged all of its; the function that waits for them."""
        import torch.distributed.checkpoint as dcp

        if self.error is not None:
            raise self.error
        if self.failed:
            self.staged = []
            return list  # nothing was started here; the caller raises rank(s) ``failed``'s error on every rank
        groups = [group(stem) for stem, _ in self.staged]  # created on the main thread, by every rank alike
        pool = ThreadPoolExecutor(max_workers=max(len(self.staged), 1), thread_name_prefix="torchbay-fsdp-save")
        started: list[tuple[str, Future]] = [
            (stem, pool.submit(dcp.save, state, checkpoint_id=str(self.directory / stem), process_group=pg))
            for (stem, state), pg in zip(self.staged, groups)]
        pool.shutdown(wait=False)  # its threads end with their writes
        self.staged = []  # the copies belong to the writers now
        self.staging.writes = [future for _, future in started]  # the buffers are theirs until these end

        def finish() -> list[str]:
            written: list[str] = []
            errors = []
            for stem, future in started:  # every write is waited for, even after one failed
                try:
                    future.result()
                    written += dcp_files_of_rank(self.directory, stem)
                except Exception as exc:
                    errors.append(f"{stem}: {type(exc).__name__}: {exc}")
            if errors:
                raise CheckpointError(f"the asynchronous DCP save failed: {'; '.join(errors)}")
            return written + after()

        return finish
