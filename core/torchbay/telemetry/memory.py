"""Memory: what each rank holds (current and peak device memory), what an out-of-memory error was made of
(parameters, gradients, optimizer state, and the rest: activations and temporaries), and the device allocator's
snapshot for torch's viewer (https://pytorch.org/memory_viz) where the device plugin can write one
(``DeviceBackend.record_memory_history`` / ``dump_memory_snapshot``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch

GIB = float(2**30)
#: the note an OOM report adds to the exception (at most one per exception)
OOM_MARK = "_torchbay_oom_report"


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct tensors (a tensor seen twice counts once; a sharded one counts its local shard)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _optimizer_tensors(optimizers: Iterable[Any]) -> Iterable[torch.Tensor]:
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state, dict):
                yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)


def memory_parts(models: list[Any], optimizers: list[Any]) -> dict[str, int]:
    """Bytes this rank holds in ``parameters``, ``gradients`` and ``optimizer`` state."""
    params = [p for m in models for p in getattr(m, "parameters", lambda: [])()]
    return {"parameters": tensor_bytes(params),
            "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": tensor_bytes(_optimizer_tensors(optimizers))}


def oom_report(models: list[Any], optimizers: list[Any], device_backend: Any, rank: int = 0) -> str:
    """What the memory of this rank held when it ran out: each part in GiB, the rest as activations and temporaries
    (allocated less the parts), with the device's total and peak."""
    parts = memory_parts(models, optimizers)
    try:
        stats = device_backend.memory_stats()
    except Exception:  # a device that cannot say: the parts alone
        stats = {}
    allocated = int(stats.get("allocated", 0))
    rest = max(allocated - sum(parts.values()), 0) if allocated else None
    lines = [f"torchbay: out of memory on rank {rank} ({getattr(device_backend, 'device', '?')}); what it held:"]
    lines += [f"  {name:<24}{size / GIB:9.3f} GiB" for name, size in parts.items()]
    if rest is not None:
        lines.append(f"  {'activations and other':<24}{rest / GIB:9.3f} GiB (allocated less the parts above)")
    for key, label in (("allocated", "allocated"), ("peak_allocated", "peak allocated"), ("total", "device total")):
        if stats.get(key):
            lines.append(f"  {label:<24}{int(stats[key]) / GIB:9.3f} GiB")
    lines.append("  to fit: a smaller batch, activation checkpointing, a sharding strategy, or a "
                 "lower precision; `torchbay estimate-memory` shows the parts before a run")
    return "\n".join(lines)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def add_oom_report(exc: BaseException, models: list[Any], optimizers: list[Any], device_backend: Any,
                   rank: int = 0, snapshot_dir: str | None = None) -> None:
    """Add the OOM report to ``exc`` as a note (the exception keeps its type: callers that catch OOM still do),
    once; write the allocator snapshot when ``snapshot_dir`` is given (``telemetry.memory_snapshot`` on a device
    that records its allocator's history)."""
    if getattr(exc, OOM_MARK, False) or not is_oom(exc):
        return
    try:
        report = oom_report(models, optimizers, device_backend, rank)
        if snapshot_dir:
            written = dump_snapshot(device_backend, snapshot_dir, f"oom.rank{rank}")
            if written:
                report += f"\n  allocator snapshot: {written} (drag it into https://pytorch.org/memory_viz)"
        exc.add_note(report)
        setattr(exc, OOM_MARK, True)
    except Exception:  # the report must never hide the error itself
        pass


def start_snapshot_recording(device_backend: Any, max_entries: int) -> bool:
    """Ask the device to record its allocator's history (what a snapshot shows); ``False`` where it cannot."""
    try:
        return bool(device_backend.record_memory_history(max_entries))
    except Exception:  # a device that fails to record: no snapshots, training goes on
        return False


def dump_snapshot(device_backend: Any, directory: str | os.PathLike, label: str) -> str | None:
    """Write ``memory_snapshot.<label>.pickle`` under ``directory`` through the device plugin; never over a file
    that is there already (a second dump of the same label gets ``.1``, ``.2``...). ``None`` when none was written."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path, n = folder / f"memory_snapshot.{label}.pickle", 0
    while path.exists():
        n += 1
        path = folder / f"memory_snapshot.{label}.{n}.pickle"
    try:
        return str(path) if device_backend.dump_memory_snapshot(str(path)) else None
    except Exception:
        return None
