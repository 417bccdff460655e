"""Collectives over the default process group, as :class:`~torchbay.plugin.Strategy` offers them: no-ops in one
process, every work kept referenced until later ones complete (see :meth:`Collectives._wait`), Python objects sent
as bytes."""

from __future__ import annotations

import pickle
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from torchbay.checkpoint.safe_load import unpickle_from_peer


class Collectives:
    """Mixed into the Strategy base: needs ``distributed``, ``world_size`` and ``rank`` from it."""

    #: how many of this strategy's latest collective works are kept referenced (see _wait)
    held_works: ClassVar[int] = 2
    _held: Any = ()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_held", None)  # the works of this process's collectives do not pickle (or travel)
        return state

    def _wait(self, work) -> None:
        """Wait for a collective's ``work`` and keep it referenced until ``held_works`` later ones complete.

        Whoever drops the last reference to a finished work destroys the tensors it holds, and
        with torch 2.13 that needs the GIL while a tensor has a Python object. On the process
        group's own thread (gloo's run loop) it first creates a Python thread state, holding
        CPython's interpreter lock, without the GIL. A fork() at that moment (a DataLoader
        starting its workers right after gather_for_metrics) gives the child that lock held, and
        on Python 3.11 the worker hangs before it runs any code: the epoch never ends (CPython
        3.12 re-creates the lock in the child first). Kept here, the work is destroyed by this
        thread, holding the GIL, once ``held_works`` later collectives have completed (by then
        gloo's thread has let go of it, unless it was starved of CPU all that time) or when the
        group is torn down. The cost: the tensors of the last ``held_works`` collectives live
        that much longer (mostly tensors the caller holds anyway: its input, the returned output).
        """
        work.wait()
        self._held = (*self._held, work)[-self.held_works:]

    def barrier(self) -> None:
        if self.distributed:
            self._wait(dist.barrier(async_op=True))

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along dim 0."""
        if not self.distributed:
            return tensor
        tensor = tensor.contiguous()
        if tensor.ndim == 0:
            tensor = tensor[None]
        out = torch.empty((self.world_size * tensor.shape[0], *tensor.shape[1:]),
                          dtype=tensor.dtype, device=tensor.device)
        self._wait(_all_gather_single(out, tensor, async_op=True))
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self.distributed:
            return tensor
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
        out = tensor.clone()
        self._wait(dist.all_reduce(out, op=ops[op], async_op=True))
        if op == "mean":
            out = out / self.world_size
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.distributed:
            self._wait(dist.broadcast(tensor, src=src, async_op=True))
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled, as torch's object collectives do)."""
        if not self.distributed:
            return obj
        if not _objects_travel_on_cpu():  # a device backend: torch's object collective picks the device
            box = [obj]
            dist.broadcast_object_list(box, src=src)
            return box[0]
        # gloo: through this strategy's own collectives, whose works _wait keeps (torch's own
        # object collectives drop theirs, and a DataLoader forks its workers right after the
        # seed broadcast of prepare())
        payload = _pickled(obj) if self.rank == src else None
        size = self.broadcast(torch.tensor([payload.numel() if payload is not None else 0]), src=src)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(payload, src=src)
        return obj if self.rank == src else unpickle_from_peer(payload)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        if not _objects_travel_on_cpu():
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj)
            return out
        payload = _pickled(obj)
        sizes = self.all_gather(torch.tensor([payload.numel()])).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        rows = self.all_gather(padded).view(self.world_size, -1)
        return [unpickle_from_peer(rows[rank, :size]) for rank, size in enumerate(sizes)]  # copies, as torch's


# torch 2.13 renamed all_gather_into_tensor; keep working on the older releases torchbay supports
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _objects_travel_on_cpu() -> bool:
    """Whether the default group's collectives take CPU tensors (gloo): objects go as bytes on the CPU."""
    return dist.get_backend() == "gloo"


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
