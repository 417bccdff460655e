"""Loading checkpoint files straight into the tensors a run already holds.

``load_state`` restores weights and optimizer state into the prepared objects without a
second full copy of the state in memory: each tensor is read from the file (``preadv`` from
the page cache) directly into the tensor it restores, or, when that tensor cannot take the
bytes as they are (another device or dtype), through a buffer of that one tensor.

- safetensors: the header is read and checked against the model's own state dict first;
  only when every tensor is there with its shape is anything written, otherwise the caller
  falls back to the ordinary full read (whose errors name what does not fit).
- optimizer ``.pt`` files: ``torch.load(mmap=True, weights_only=True)`` gives the structure
  with every tensor still on disk; each tensor is then read into the optimizer's existing
  state tensor of the same shape and dtype (a new one where there is none) and the state dict
  is handed to ``optimizer.load_state_dict``, which keeps those tensors as they are. The
  mapping's pages are not touched (the bytes are read with ``preadv`` at the tensor's offset
  in the file, found in ``/proc/self/maps``); where that is not possible, the tensor is copied
  from the mapping.

Both are planned first, changing nothing (:func:`plan_safetensors`, :func:`plan_optimizer`:
the default ``Strategy.read_checkpoint`` does it beside the checksum verification), and run
(:func:`run_reads`, :meth:`OptimizerPlan.apply`) only once every file is verified.

Nothing here unpickles anything but weights (``weights_only``, see :mod:`torchbay.storage.safe_load`).
"""

from __future__ import annotations

import json
import os
import struct
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from torchbay.errors import CheckpointError
from torchbay.storage.safe_load import safe_torch_load

#: safetensors dtype names -> torch dtypes (those this torch has)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)

READ_CHUNK = 64 << 20  # one preadv call at most (some kernels cap a read at 2 GiB)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous cpu tensor's bytes."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + READ_CHUNK]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path} ended early (it was truncated while being read)")
        done += n


def _direct(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the file's bytes can be read straight into ``target``."""
    return (target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
            and target.layout == torch.strided and not target.is_conj() and not target.is_neg())


def read_into(fd: int, offset: int, dtype: torch.dtype, target: torch.Tensor, path: Path) -> None:
    """Read ``target.numel()`` values of ``dtype`` at ``offset`` of ``fd`` into ``target``."""
    if target.numel() == 0:
        return
    if _direct(target, dtype):
        _pread_exact(fd, _bytes_of(target), offset, path)
        return
    staging = torch.empty(target.shape, dtype=dtype)  # one tensor's worth, freed after the copy
    _pread_exact(fd, _bytes_of(staging), offset, path)
    with torch.no_grad():
        target.copy_(staging)


# --- safetensors ------------------------------------------------------------------------------


#: the largest header torchbay reads (safetensors itself refuses larger ones)
MAX_HEADER = 100 << 20


def read_header_json(fp) -> tuple[int, dict[str, Any]]:
    """``(header length, parsed header)`` of the open safetensors file ``fp``; ``ValueError``
    when it has none (too short, a length past the file or over 100 MiB, not a JSON object)."""
    size = os.fstat(fp.fileno()).st_size
    head = os.pread(fp.fileno(), 8, 0)
    if len(head) != 8:
        raise ValueError("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER:
        raise ValueError("header larger than 100 MiB")
    if length > size - 8:
        raise ValueError("header longer than the file")
    try:
        header = json.loads(os.pread(fp.fileno(), length, 8))
    except UnicodeDecodeError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return length, header


def safetensors_header(fp, path: Path) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]] | None:
    """``(data start, {key: (dtype, shape, begin, end)})`` of an open safetensors file; ``None``
    when the header is not one this reader understands (the caller reads the file the usual way)."""
    size = os.fstat(fp.fileno()).st_size
    try:
        length, header = read_header_json(fp)
    except ValueError:
        return None
    start, data_size, out = 8 + length, size - 8 - length, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return None
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_size or end - begin != numel * dtype.itemsize:
            return None
        out[key] = (dtype, shape, begin, end)
    return start, out


class Read:
    """One tensor to fill: from ``path`` at ``offset`` (values of ``dtype``), or from ``source``."""

    __slots__ = ("path", "offset", "dtype", "target", "source")

    def __init__(self, path: Path, offset: int | None, dtype: torch.dtype, target: torch.Tensor,
                 source: torch.Tensor | None = None):
        self.path, self.offset, self.dtype, self.target, self.source = path, offset, dtype, target, source

    @property
    def nbytes(self) -> int:
        return self.target.numel() * self.dtype.itemsize


def run_reads(reads: list[Read], threads: int | None = None) -> None:
    """Fill every target; the reads are shared out to a few threads (``preadv`` runs without the GIL)."""
    threads = threads or min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else os.cpu_count() or 1)
    total = sum(r.nbytes for r in reads)
    if threads <= 1 or total < (32 << 20):
        _run(reads)
        return
    parts: list[list[Read]] = [[] for _ in range(threads)]
    sizes = [0] * threads
    for read in sorted(reads, key=lambda r: -r.nbytes):  # largest first, each to the least loaded thread
        i = sizes.index(min(sizes))
        parts[i].append(read)
        sizes[i] += read.nbytes
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for done in [pool.submit(_run, part) for part in parts if part]:
            done.result()


def _run(reads: list[Read]) -> None:
    fds: dict[Path, int] = {}
    try:
        for read in reads:
            if read.offset is None:
                with torch.no_grad():
                    read.target.copy_(read.source)
                continue
            if read.path not in fds:
                fds[read.path] = os.open(read.path, os.O_RDONLY)
            read_into(fds[read.path], read.offset, read.dtype, read.target, read.path)
    finally:
        for fd in fds.values():
            os.close(fd)


def plan_safetensors(files: list[Path], aliases: dict[str, str], template: dict[str, Any]) -> list[Read] | None:
    """The reads that put the tensors of ``files`` into the tensors of ``template`` (a module's
    ``state_dict()``), in place; ``None`` unless every tensor of the template is in the files
    with its shape and the files hold nothing else. Reads headers only; changes nothing."""
    where: dict[str, tuple] = {}  # key -> (file, data start, dtype, begin, shape)
    for path in files:
        with open(path, "rb") as fp:
            parsed = safetensors_header(fp, path)
        if parsed is None:
            return None
        start, entries = parsed
        for key, (dtype, shape, begin, _) in entries.items():
            where[key] = (path, start, dtype, begin, shape)
    tensors = {k: v for k, v in template.items() if isinstance(v, torch.Tensor)}
    stored = {k: aliases.get(k, k) for k in tensors}
    if set(where) - set(stored.values()):
        return None  # keys the model does not have: the full read names them
    for key, source in stored.items():
        if source not in where or tuple(where[source][4]) != tuple(tensors[key].shape):
            return None
    reads, seen = [], set()
    for key, source in stored.items():
        target = tensors[key]
        ident = (target.data_ptr(), target.dtype, tuple(target.shape), target.device)
        if ident in seen and target.numel():
            continue  # a tie (one storage under several names) is read once
        seen.add(ident)
        path, start, dtype, begin, _ = where[source]
        reads.append(Read(path, start + begin, dtype, target))
    return reads


# --- optimizer state --------------------------------------------------------------------------


def _mappings_of(path: Path) -> list[tuple[int, int, int]]:
    """``(start, end, file offset)`` of this process's mappings of ``path`` (Linux), else []."""
    try:
        st = os.stat(path)
        out = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 5 or int(parts[4]) != st.st_ino:
                    continue
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                if os.makedev(major, minor) != st.st_dev:
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, int(parts[2], 16)))
        return out
    except (OSError, ValueError):
        return []


def _tensors(value: Any, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    return out


def plain_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under torchbay's (or Accelerate's) wrappers when its state dict is
    torch's own (no load hooks, no overridden (load_)state_dict), else ``None``."""
    inner = optimizer
    for _ in range(4):
        wrapped = getattr(inner, "optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer) or wrapped is inner:
            break
        inner = wrapped
    if not isinstance(inner, torch.optim.Optimizer):
        return None
    cls = type(inner)
    if cls.load_state_dict is not torch.optim.Optimizer.load_state_dict or \
            cls.state_dict is not torch.optim.Optimizer.state_dict:
        return None
    if getattr(inner, "_optimizer_load_state_dict_pre_hooks", None) or \
            getattr(inner, "_optimizer_state_dict_pre_hooks", None) or \
            getattr(inner, "_optimizer_state_dict_post_hooks", None):
        return None
    return inner


class OptimizerPlan:
    """What :func:`plan_optimizer` read: the state dict to load and the reads that fill it."""

    def __init__(self, optimizer: Any, state: dict, reads: list[Read]):
        self.optimizer, self.state, self.reads = optimizer, state, reads

    def apply(self) -> None:
        run_reads(self.reads)
        self.reads = []
        self.optimizer.load_state_dict(self.state)  # keeps the filled tensors (same dtype and device)


def plan_optimizer(optimizer: Any, path: Path, what: str, trusted: bool = False) -> OptimizerPlan | None:
    """Read the structure of the optimizer state at ``path`` (its tensors stay on disk) and plan
    to read each tensor into the optimizer's existing state tensor (or a new one); ``None`` when
    this way does not apply. Changes nothing."""
    inner = plain_torch_optimizer(optimizer)
    if inner is None:
        return None
    try:
        state = safe_torch_load(path, what, trusted=trusted, mmap=True)
    except CheckpointError:
        return None  # e.g. a legacy (non-zip) file: the plain read reports real problems
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or \
            not isinstance(state.get("param_groups"), list):
        return None
    groups = inner.param_groups
    saved_groups = state["param_groups"]
    if len(groups) != len(saved_groups) or any(
            not isinstance(s, dict) or not isinstance(s.get("params"), list) or len(s["params"]) != len(g["params"])
            for g, s in zip(groups, saved_groups)):
        return None  # load_state_dict refuses it, with its own message
    if any(not isinstance(v, torch.Tensor) and _tensors(v, []) for entries in state["state"].values()
           if isinstance(entries, dict) for v in entries.values()):
        return None  # tensors nested in containers: left to load_state_dict as they are
    loaded = _tensors(state["state"], [])
    ptrs = [t.data_ptr() for t in loaded if t.numel()]
    if len(set(ptrs)) != len(ptrs) or not all(
            t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in loaded):
        return None  # tensors sharing storage: torch.load's own sharing must be kept
    current = inner.state_dict()  # the same tensor objects as the optimizer's state, by index
    index_of = dict(zip(chain.from_iterable(s["params"] for s in saved_groups),
                        chain.from_iterable(g["params"] for g in current["param_groups"])))
    mappings = _mappings_of(path)
    used: set[int] = set()
    reads = []
    for saved_id, entries in state["state"].items():
        if not isinstance(entries, dict):
            continue
        have = current["state"].get(index_of.get(saved_id), {})
        for name, value in list(entries.items()):
            if not isinstance(value, torch.Tensor):
                continue
            target = have.get(name)
            if not (isinstance(target, torch.Tensor) and target.shape == value.shape and target.dtype == value.dtype
                    and id(target) not in used):
                target = torch.empty(value.shape, dtype=value.dtype)  # no state to reuse: a new tensor
            used.add(id(target))
            offset = _file_offset(value, mappings) if value.numel() else None
            reads.append(Read(path, offset, value.dtype, target, source=None if offset is not None else value))
            entries[name] = target
    return OptimizerPlan(optimizer, state, reads)


def _file_offset(value: torch.Tensor, mappings: list[tuple[int, int, int]]) -> int | None:
    start = value.data_ptr()
    end = start + value.numel() * value.element_size()
    for begin, stop, offset in mappings:
        if begin <= start and end <= stop:
            return start - begin + offset
    return None
