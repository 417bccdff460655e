"""Asynchronous ``save_state``: the state is copied in the call, written in the background.

``save_state(dir, blocking=False)`` takes a copy of everything a checkpoint holds into a
:class:`StagingBuffer` (reused from one save to the next; page-locked where the device backend
says host memory can be pinned), starts one writer thread and returns an :class:`AsyncSave`.
The thread runs the same writer as a synchronous save (``Strategy.save_checkpoint``, the same
``torch_save_recorded`` files, fsync'ed and hashed) into ``<dir>.partial``; the publish
(manifest, rename, rotation) is the same code too (:mod:`torchbay.checkpoint.checkpointer`).

Where collectives happen: never in the writer thread. With one process the thread also
publishes (nothing to agree on). With several, the cross-rank agreement (every rank's part
written, else the same error on every rank) and the publish run on the main thread at a defined
point: ``handle.wait()``, the next ``save_state``, ``load_state`` or ``end_training``, each of
which every rank calls in the same order.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import sys
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("torchbay")


class StagingBuffer:
    """Host tensors that hold a copy of the state between the call and the write; reused.

    A buffer is kept per position in the state (its path of keys) and reused while its shape
    and dtype stay the same, so saves after the first allocate nothing. Tensors that share
    memory (tied weights) are copied once and stay shared in the copy.
    """

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._from_device = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()

    def begin(self) -> None:
        self._used = set()
        self._memo: dict[tuple, torch.Tensor] = {}
        self._from_device = False

    def finish(self, synchronize: Callable[[], None]) -> None:
        """Wait for copies from the device (issued without blocking), drop buffers no longer used."""
        if self._from_device:
            synchronize()
        for key in set(self._buffers) - self._used:
            del self._buffers[key]
        self._memo = {}

    def copy(self, obj: Any, path: str = "") -> Any:
        """A copy of ``obj``: tensors into buffers, containers rebuilt, other values deep-copied."""
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, dict):
            out = OrderedDict() if isinstance(obj, OrderedDict) else type(obj)() if type(obj) is dict else {}
            for key, value in obj.items():
                out[key] = self.copy(value, f"{path}/{key!r}")
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:  # a module state dict's version information
                out._metadata = copy.deepcopy(metadata)
            return out
        if isinstance(obj, list):
            return [self.copy(value, f"{path}[{i}]") for i, value in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self.copy(value, f"{path}({i})") for i, value in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.layout != torch.strided or type(tensor) is not torch.Tensor:
            return tensor.clone().cpu()  # rare kinds (sparse, subclasses): a plain copy
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype, tensor.device) if tensor.numel() else None
        if key is not None and key in self._memo:
            return self._memo[key]
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._allocate(tensor)
            self._buffers[path] = buffer
        self._used.add(path)
        from_device = tensor.device.type != "cpu"
        buffer.copy_(tensor, non_blocking=from_device and self.pin_memory)
        self._from_device |= from_device
        if key is not None:
            self._memo[key] = buffer
        return buffer

    def _allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.pin_memory and tensor.device.type != "cpu":
            try:
                return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            except RuntimeError:  # pinning refused (no pinned allocator, locked-memory limit): plain memory
                self.pin_memory = False
        return torch.empty(tensor.shape, dtype=tensor.dtype)


class Staged:
    """Stands in for a prepared model or optimizer in the writer: its ``state_dict()`` is the copy."""

    def __init__(self, state: Any):
        self._state = state

    def state_dict(self) -> Any:
        return self._state

    def parameters(self):
        return iter(())


class AsyncSave:
    """What ``save_state(..., blocking=False)`` returns.

    ``wait()`` blocks until the checkpoint is published and re-raises the save's error (every
    rank calls it: with several processes it is where the ranks agree, a collective);
    ``done()`` says whether the save is over (published, or failed: ``wait()`` says which);
    ``path`` is where it is published (``str(handle)`` and ``os.fspath(handle)`` give it too).
    """

    def __init__(self, path: Path, finish: Callable[["AsyncSave"], None] | None):
        self.path = Path(path)
        self._finish = finish  # agreement + publish on the calling thread; None once finished
        self._thread: threading.Thread | None = None
        self._written = threading.Event()  # the writer thread is over
        self._published = False
        self.publishes_itself = False  # one process: the writer thread publishes too
        self.local_records: dict | None = None  # this rank's files, when the writer succeeded
        self.finish_started: Callable[[], list[str]] | None = None  # a strategy's own writes (start_checkpoint)
        self.discard_unpublished: Callable[[], None] | None = None  # removes the partial folder (a failed save)
        self.error: BaseException | None = None

    # -- the user's API -------------------------------------------------------------------
    def wait(self) -> str:
        """Block until published; the path. Raises the save's error (a ``CheckpointError``)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish(self)
        if self.error is not None:
            raise self.error
        return str(self.path)

    def done(self) -> bool:
        """Whether the save is over: published, or failed. With several processes a save is over
        only once ``wait()`` (or the next save_state, load_state, end_training) agreed on it."""
        return self._finish is None or (self.publishes_itself and self._written.is_set())

    def written(self) -> bool:
        """Whether this rank's writer thread has finished (its part is on disk, or it failed)."""
        return self._written.is_set()

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        state = "published" if self._published and self.error is None else \
            "failed" if self.error is not None and self._finish is None else "in flight"
        return f"<AsyncSave {self.path} {state}>"

    # -- torchbay's side ------------------------------------------------------------------
    def start(self, work: Callable[[], None], nice: int = 0) -> None:
        def run() -> None:
            try:
                lower_thread_priority(nice)
                work()
            except BaseException as exc:  # kept for wait(); never lost
                self.error = exc
            finally:
                self._written.set()

        self._thread = threading.Thread(target=run, name=f"torchbay-save-{self.path.name}", daemon=False)
        _in_flight.add(self)
        self._thread.start()

    def mark_published(self) -> None:
        self._published = True

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        _in_flight.discard(self)


def lower_thread_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by ``increment`` (Linux, where a thread has its own nice value;
    elsewhere the call would change the whole process's, so it does nothing). A writer that shares busy cores
    with the training loop then lets the loop go first; on idle cores it runs as fast as before."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + increment)
    except OSError as exc:  # a sandbox that forbids it: the write goes on at the loop's priority
        log.debug("torchbay: could not lower the checkpoint writer's priority: %s", exc)


def completed(path: Path) -> AsyncSave:
    """A handle for a save that already happened synchronously."""
    handle = AsyncSave(path, None)
    handle.mark_published()
    handle._written.set()
    return handle


_in_flight: "weakref.WeakSet[AsyncSave]" = weakref.WeakSet()


def _wait_at_exit() -> None:
    """Interpreter exit waits for every background write (non-daemon threads are joined before
    atexit too; this also reports a failure). With one process the writer has published; with
    several, a save no rank agreed on stays unpublished (as after a crash) and is named."""
    for handle in list(_in_flight):
        handle.join()
        if handle.error is not None and handle._finish is not None:
            log.error("torchbay: the asynchronous save to %s failed: %s", handle.path, handle.error)
        elif handle._finish is not None and not handle._published:
            log.warning("torchbay: the asynchronous save to %s was written but not published: with several "
                        "processes call handle.wait() or accelerator.end_training() on every rank before exit; "
                        "the next save_state to that path removes the unpublished part", handle.path)


# Run when the main thread ends, before concurrent.futures refuses new work (its own hook is
# registered the same way, on import, and these hooks run last-registered first): the writer
# still uses thread pools. atexit too, where that private hook is missing.
import concurrent.futures.thread  # noqa: E402,F401  (registers its hook first)

_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_wait_at_exit)
else:  # pragma: no cover
    atexit.register(_wait_at_exit)
