"""The FSDP strategy's asynchronous checkpoint (``save_state(blocking=False)``), FSDP1 and FSDP2 alike.

In the call, on the main thread of every rank: each model's and optimizer's sharded state dict
(``get_model_state_dict`` / ``get_optimizer_state_dict``: FSDP2's DTensors, FSDP1's ShardedTensors)
is copied into host memory (:func:`host_copy`); the ranks then agree that every one of them holds
its copy. Only then does each rank start one thread per model and optimizer that writes its copy
with ``torch.distributed.checkpoint.save`` (what ``dcp.async_save`` runs in its own thread), its
collectives on a gloo group of that save's own, never the training loop's.

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


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied into new host memory (sharded tensors keep their sharding)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(obj, ShardedTensor):
        return obj.to("cpu", copy=True)  # new local shards; the placements in its metadata say cpu
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)  # a DTensor copies its local shard, keeps mesh and placements
    if isinstance(obj, dict):
        return type(obj)((key, host_copy(value)) for key, value in obj.items())
    if isinstance(obj, list):
        return [host_copy(value) for value in obj]
    if type(obj) is tuple:
        return tuple(host_copy(value) for value in obj)
    return copy.deepcopy(obj)


class AgreedStart:
    """The writes of one asynchronous save, started once every rank staged its state.

    ``stage(stem, take)`` runs ``take()`` (the state dict) and copies it; then the ranks agree
    (``all_gather_object`` on the training loop's group, on the main thread: every rank calls
    ``save_state`` at the same point) that every one of them did, before any rank goes on to the
    next state dict (FSDP1's optimizer state dict is itself collective: a rank that skipped it
    would leave the others waiting in it). Once a rank failed, no rank stages more or starts a
    write: :meth:`start` raises the error on the failing rank and returns a ``finish`` that wrote
    nothing on the others; the caller's own agreement (torchbay's ``save_state``) then raises on
    every rank, naming the failing one.
    """

    def __init__(self, strategy: Any, directory: Path):
        self.strategy = strategy
        self.directory = directory
        self.staged: list[tuple[str, Any]] = []
        self.error: BaseException | None = None
        self.failed: list[int] = []  # the ranks that could not take their state

    def stage(self, stem: str, take: Callable[[], Any]) -> None:
        if self.failed:
            return
        try:
            self.staged.append((stem, host_copy(take())))
        except Exception as exc:
            self.error = exc
        message = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        self.failed = [rank for rank, m in enumerate(self.strategy.all_gather_object(message)) if m]

    def start(self, group: Callable[[str], Any], after: Callable[[], list[str]]) -> Callable[[], list[str]]:
        """One writer thread per staged state, if every rank staged all of its; the function that waits for them."""
        import torch.distributed.checkpoint as dcp

        from torchbay.plugin import dcp_files_of_rank

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
