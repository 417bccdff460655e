"""Collectives over the default process group, as :class:`~torchbay.plugin.Strategy` offers them: no-ops in one
process, every work kept referenced until later ones complete (see :meth:`ProcessCollectives.wait`), Python objects
sent as bytes. The Strategy base holds one :class:`ProcessCollectives` (``strategy.collectives``) and its methods of
the same names hand over to it."""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

from torchbay.storage.safe_load import unpickle_from_peer


class GroupMember(Protocol):
    """What the collectives need to know of the process they run in (the strategy that holds them)."""

    @property
    def distributed(self) -> bool: ...  # whether a process group is up

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class ProcessCollectives:
    """The collectives of ``member`` (the strategy holding them), keeping the works of the latest ``keep``
    collectives referenced (``held``, see :meth:`wait`)."""

    def __init__(self, member: GroupMember, keep: int = 2):
        self.member = member
        self.keep = keep
        self.held: tuple[Any, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "held": ()}  # the works of this process's collectives do not pickle (or travel)

    @property
    def distributed(self) -> bool:
        return self.member.distributed

    @property
    def rank(self) -> int:
        return self.member.rank

    @property
    def world_size(self) -> int:
        return self.member.world_size

    def wait(self, work) -> None:
        """Wait for a collective's ``work`` and keep it referenced until ``keep`` later ones complete.

        Whoever drops the last reference to a finished work destroys the tensors it holds, and
        with torch 2.13 that needs the GIL while a tensor has a Python object. On the process
        group's own thread (gloo's run loop) it first creates a Python thread state, holding
        CPython's interpreter lock, without the GIL. A fork() at that moment (a DataLoader
        starting its workers right after gather_for_metrics) gives the child that lock held, and
        on Python 3.11 the worker hangs before it runs any code: the epoch never ends (CPython
        3.12 re-creates the lock in the child first). Kept here, the work is destroyed by this
        thread, holding the GIL, once ``keep`` later collectives have completed (by then
        gloo's thread has let go of it, unless it was starved of CPU all that time) or when the
        group is torn down (:meth:`release`). The cost: the tensors of the last ``keep``
        collectives live that much longer (mostly tensors the caller holds anyway: its input, the returned output).
        """
        work.wait()
        self.held = (*self.held, work)[-self.keep:]

    def release(self) -> None:
        """Let go of the kept works (once the process group is destroyed: see the strategy's ``teardown``)."""
        self.held = ()

    def barrier(self) -> None:
        if self.distributed:
            self.wait(dist.barrier(async_op=True))

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along dim 0."""
        if not self.distributed:
            return tensor
        tensor = tensor.contiguous()
        if tensor.ndim == 0:
            tensor = tensor[None]
        out = torch.empty((self.world_size * tensor.shape[0], *tensor.shape[1:]),
                          dtype=tensor.dtype, device=tensor.device)
        self.wait(_all_gather_single(out, tensor, async_op=True))
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self.distributed:
            return tensor
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
        out = tensor.clone()
        self.wait(dist.all_reduce(out, op=ops[op], async_op=True))
        if op == "mean":
            out = out / self.world_size
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.distributed:
            self.wait(dist.broadcast(tensor, src=src, async_op=True))
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (pickled, as torch's object collectives do)."""
        if not self.distributed:
            return obj
        if not _objects_travel_on_cpu():  # a device backend: torch's object collective picks the device
            box = [obj]
            dist.broadcast_object_list(box, src=src)
            return box[0]
        # gloo: through this strategy's own collectives, whose works wait() keeps (torch's own
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
