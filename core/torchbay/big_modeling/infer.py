"""Choosing a device map: ``infer_auto_device_map`` and ``get_balanced_memory``.

``infer_auto_device_map`` places a model by Accelerate's rules, so that both infer the same map:

- The model is placed piece by piece in definition order (its own parameters, its children, its
  own buffers), filling the devices of ``max_memory`` in turn: accelerator indexes, ``"cpu"``,
  then ``"disk"``. A module split into pieces gives its own parameters and its children.
- The first accelerator and the cpu keep room for the largest layer still to place: offloaded
  layers are brought there one at a time to run (with no accelerator, the cpu alone; on a device
  whose memory is the host's, ``DeviceBackend.shares_host_memory``, that device alone). A layer is
  a module without children or of a class in ``no_split_module_classes``; at the start, a tensor
  of the model too.
- A piece that does not fit in what is left is split into its pieces unless it is a layer; a
  layer moves on to the next device, the room the device kept then counting as used.
- A piece holding a tied weight takes along the pieces that hold its other names, onto its
  device. When the piece fits alone but not with them, the first of them that can be split is
  split and the piece tried again; when none can, the piece moves on.
- ``fallback_allocation``: before a device is left empty, the first piece further on (searched
  depth first, into splittable pieces) that fits there is placed there instead.
- Without ``offload_buffers``, the buffers of the pieces offloaded to the cpu or disk are brought
  to the accelerator together: a warning says when they fit on no accelerator.

Where torchbay differs, on purpose: a split module's own buffers, which no piece places, go to
the device of the module's first placed piece (Accelerate leaves them out of the map: its
clean-up hides that when the module's pieces share a device, else ``check_device_map`` refuses
the map); a piece holding several names tied to the one placed counts once; with
``offload_to_disk=False`` or a ``"disk"`` budget, what fits nowhere raises a
:class:`~torchbay.errors.ConfigError` naming it.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import defaultdict
from typing import Any

from torch import nn

from torchbay.big_modeling.device_map import (
    CPU,
    DISK,
    _error,
    _splittable,
    _units,
    accelerator_class,
    all_tensor_names,
    clean_device_map,
    compute_module_sizes,
    device_of,
    find_tied_parameters,
    get_max_layer_size,
    get_max_memory,
)

log = logging.getLogger("torchbay")

Piece = tuple[str, Any]  # (name in the model, module or tensor)


def _mb(size: float) -> str:
    """A size for messages: bytes, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:,.2f} {unit}"
    return f"{int(size)} bytes"


def get_balanced_memory(model: nn.Module, max_memory: dict[int | str, int | str] | None = None,
                        no_split_module_classes: list[str] | None = None, dtype: Any = None,
                        special_dtypes: dict[str, Any] | None = None, low_zero: bool = False) -> dict[int | str, int]:
    """A ``max_memory`` that spreads the model evenly over the accelerators (``low_zero``: the
    first one gets only what the others cannot hold, leaving it room to generate)."""
    budgets = get_max_memory(max_memory)
    accelerators = [d for d in budgets if isinstance(d, int) and budgets[d] > 0]
    if len(accelerators) <= 1:
        return budgets
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    layer, _ = get_max_layer_size(_units(model, ""), sizes, no_split_module_classes or [])
    sharing = accelerators[1:] if low_zero else accelerators
    target = math.ceil(sizes[""] / len(sharing)) + layer  # a layer may straddle the boundary between two devices
    for device in sharing:
        budgets[device] = min(budgets[device], target)
    if low_zero:
        first = accelerators[0]
        budgets[first] = min(budgets[first], max(0, sizes[""] - sum(budgets[d] for d in sharing)))
    return budgets


def infer_auto_device_map(model: nn.Module, max_memory: dict[int | str, int | str] | None = None,
                          no_split_module_classes: list[str] | None = None, dtype: Any = None,
                          special_dtypes: dict[str, Any] | None = None, verbose: bool = False,
                          clean_result: bool = True, offload_buffers: bool = False,
                          fallback_allocation: bool = False, *, offload_to_disk: bool | None = None) -> dict[str, Any]:
    """A device map for ``model`` within ``max_memory`` (default: what the device plugins report),
    placed by the rules of this module's docstring (Accelerate's).

    ``offload_to_disk``: ``None`` (Accelerate's behaviour) lets what fits nowhere go to
    ``"disk"``; ``False`` raises a :class:`~torchbay.errors.ConfigError` instead, naming the
    module that does not fit and by how much (``load_checkpoint_and_dispatch`` passes ``False``
    without an ``offload_folder``).
    """
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    planner = _Planner(model, get_max_memory(max_memory), list(no_split_module_classes or []), dtype, special_dtypes,
                       offload_to_disk is not False, verbose)
    placed = planner.run(fallback_allocation)
    planner.report(offload_buffers)
    _cover(model, placed)
    return clean_device_map(dict(placed)) if clean_result else placed


class _Planner:
    """One placement: the pieces still to place (a queue), what each device holds, the largest
    layer still to place (the room the first accelerator and the cpu keep)."""

    def __init__(self, model: nn.Module, budgets: dict[Any, int], no_split: list[str], dtype: Any,
                 special_dtypes: dict[str, Any] | None, disk_ok: bool, verbose: bool):
        self.model = model
        self.budgets = dict(budgets)
        self.devices = list(self.budgets)
        if DISK not in self.budgets and disk_ok:
            self.devices.append(DISK)
            self.budgets[DISK] = math.inf
        self.keeps_room = _keeps_room(self.devices)
        self.no_split = no_split
        self.sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
        self.buffer_sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True)
        self.ties = find_tied_parameters(model)
        self.verbose = verbose
        self.queue: list[Piece] = _pieces(model, "", buffers=True)
        self.layer, self.layer_names = get_max_layer_size(self.queue, self.sizes, no_split)  # tensors count at first
        self.used: dict[Any, float] = defaultdict(int)
        self.left_empty: dict[Any, float] = {}  # device -> what its first piece needed
        self.offloaded_buffers = 0
        self.index = 0

    def _refresh_layer(self) -> None:
        modules = [piece for piece in self.queue if isinstance(piece[1], nn.Module)]
        self.layer, self.layer_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def _taking(self, name: str) -> None:
        """``name`` leaves the queue: the largest layer is looked for again once all of its holders have."""
        self.layer_names = [n for n in self.layer_names if not _under(n, name)]
        if not self.layer_names:
            self._refresh_layer()

    def run(self, fallback_allocation: bool) -> dict[str, Any]:
        placed: dict[str, Any] = {}
        while self.queue:
            name, obj = self.queue.pop(0)
            self._taking(name)
            size = self.sizes.get(name, 0)
            holders = _holders(_partners(name, self.ties), self.queue)
            with_ties = size + sum(self.sizes.get(h, 0) - sum(self.sizes.get(p, 0) for p in parts)
                                   for h, (_, parts) in holders.items())
            device = self.devices[self.index]
            kept = self.layer if device in self.keeps_room else 0
            room = self.budgets[device] - kept - self.used[device]
            if with_ties <= room:
                self._place(placed, name, device, with_ties, holders)
                continue
            if holders and size <= room and self._split_a_holder(name, obj, holders):
                continue
            if size >= room and isinstance(obj, nn.Module) and _splittable(obj, self.no_split):
                if self.verbose:
                    log.info("%s (%s) does not fit in the %s left on %s: split", name, _mb(size), _mb(room), device)
                self.queue = _pieces(obj, name) + self.queue
                self._refresh_layer()
                continue
            if fallback_allocation and not self.used[device] and device != DISK:
                limit = self.budgets[device] - max(self.layer, with_ties)
                found = _first_fitting(self.queue, self.sizes, self.ties, self.no_split, limit)
                if found is not None:
                    first, rest = _take_out(self.queue, found)
                    self.queue = [first, (name, obj)] + rest
                    continue
            self._move_on(name, obj, with_ties, kept)
        return placed

    def _place(self, placed: dict[str, Any], name: str, device: Any, size: float, holders: dict) -> None:
        placed[name] = device
        self.used[device] += size
        taken = [name]
        for holder in holders:
            self.queue = [piece for piece in self.queue if piece[0] != holder]
            placed[holder] = device
            taken.append(holder)
        if device in (CPU, DISK):
            self.offloaded_buffers += sum(self.buffer_sizes.get(n, 0) for n in taken)
        if self.verbose:
            log.info("%s (%s) -> %s", " and ".join(taken), _mb(size), device)

    def _split_a_holder(self, name: str, obj: Any, holders: dict) -> bool:
        """Split the first holder of a tied name that can be, and put ``name`` back first (it fits
        alone but not with them)."""
        for holder, (module, _) in holders.items():
            if isinstance(module, nn.Module) and _splittable(module, self.no_split):
                if self.verbose:
                    log.info("%s fits but not with %s (tied): %s is split", name, list(holders), holder)
                at = next(i for i, piece in enumerate(self.queue) if piece[0] == holder)
                self.queue = [(name, obj)] + self.queue[:at] + _pieces(module, holder) + self.queue[at + 1:]
                self._refresh_layer()
                return True
        return False

    def _move_on(self, name: str, obj: Any, needed: float, kept: float) -> None:
        """``name`` goes on to the next device; the room this one kept counts as used."""
        device = self.devices[self.index]
        if not self.used[device]:
            self.left_empty[device] = needed + kept
        if self.index + 1 == len(self.devices):
            raise _no_room(name, obj, self.sizes.get(name, 0), self)
        self.used[device] += kept
        self.index += 1
        self.queue.insert(0, (name, obj))
        if self.verbose:
            log.info("%s (%s) does not fit on %s: next device %s", name, _mb(needed), device, self.devices[self.index])

    def report(self, offload_buffers: bool) -> None:
        """The warning about offloaded buffers, and the log of the devices left empty."""
        accelerators = [d for d in self.budgets if isinstance(d, int)]
        if (self.offloaded_buffers and not offload_buffers and accelerators
                and not any(self.budgets[d] >= self.offloaded_buffers + self.used[d] for d in accelerators)):
            warnings.warn(f"the layers offloaded to the cpu or disk hold {_mb(self.offloaded_buffers)} of buffers, "
                          f"brought to the accelerator all together, and no accelerator has that much left in "
                          f"max_memory: if the model runs out of memory, pass offload_buffers=True (they are then "
                          f"brought with their layer)", stacklevel=3)
        if self.left_empty:
            needs = ", ".join(f"{d!r} needs at least {int(n)} bytes" for d, n in self.left_empty.items())
            log.info("insufficient memory: nothing could be placed on %s (%s: the next piece with its tied pieces, "
                     "plus the room kept for the largest layer); raise max_memory there or pass "
                     "fallback_allocation=True", ", ".join(map(repr, self.left_empty)), needs)


def _keeps_room(devices: list[Any]) -> set[Any]:
    """The devices that keep room for the largest layer (offloaded layers are brought there to run)."""
    accelerators = [d for d in devices if isinstance(d, int)]
    if not accelerators:
        return {CPU}
    cls = accelerator_class()
    if cls is not None and getattr(cls, "shares_host_memory", False):  # the cpu's memory is the device's
        return {accelerators[0]}
    return {accelerators[0], CPU}


def _pieces(module: nn.Module, prefix: str, buffers: bool = False) -> list[Piece]:
    """What placing ``module`` piece by piece means: its own parameters, its children (and, for
    the model itself, its own buffers)."""
    join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    return ([(join(n), p) for n, p in module.named_parameters(recurse=False)]
            + [(join(n), c) for n, c in module.named_children()]
            + ([(join(n), b) for n, b in module.named_buffers(recurse=False)] if buffers else []))


def _cover(model: nn.Module, placed: dict[str, Any]) -> None:
    """Give each tensor the map leaves out (a split module's own buffers) the device of the first
    piece placed within its module."""
    for name in all_tensor_names(model):
        try:
            device_of(name, placed)
            continue
        except KeyError:
            pass
        owner = name.rpartition(".")[0]
        while True:
            inside = next((d for key, d in placed.items() if _under(key, owner)), None)
            if inside is not None or not owner:
                break
            owner = owner.rpartition(".")[0]
        if inside is not None:
            placed[name] = inside


def _under(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


def _partners(name: str, ties: list[list[str]]) -> list[str]:
    """The tied names outside ``name`` of the groups with a name inside it."""
    out = []
    for group in ties:
        outside = [p for p in group if not _under(p, name)]
        if outside and len(outside) < len(group):
            out += outside
    return out


def _holders(partners: list[str], queue: list[Piece]) -> dict[str, tuple[Any, list[str]]]:
    """The pieces of ``queue`` that hold ``partners``: ``{name: (piece, the partners in it)}``, in
    the partners' order (a partner already placed has none)."""
    out: dict[str, tuple[Any, list[str]]] = {}
    for partner in partners:
        holder = next(((n, obj) for n, obj in queue if _under(partner, n)), None)
        if holder is not None:
            out.setdefault(holder[0], (holder[1], []))[1].append(partner)
    return out


def _first_fitting(queue: list[Piece], sizes: dict[str, int], ties: list[list[str]], no_split: list[str],
                   limit: float) -> str | None:
    """The first piece of ``queue`` (depth first, into splittable pieces) that fits in ``limit``
    with the pieces holding its tied names."""
    stack = list(queue)
    while stack:
        name, obj = stack.pop(0)
        holders = _holders(_partners(name, ties), stack)
        size = sizes.get(name, 0) + sum(sizes.get(h, 0) - sum(sizes.get(p, 0) for p in parts)
                                        for h, (_, parts) in holders.items())
        if size <= limit:
            return name
        if isinstance(obj, nn.Module) and _splittable(obj, no_split):
            stack = _pieces(obj, name) + stack
    return None


def _take_out(queue: list[Piece], name: str) -> tuple[Piece, list[Piece]]:
    """``name`` and the rest of ``queue``, its ancestors there split into their pieces."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        ancestor = ".".join(parts[:depth])
        at = next((i for i, piece in enumerate(queue) if piece[0] == ancestor), None)
        if at is not None:
            queue = queue[:at] + _pieces(queue[at][1], ancestor) + queue[at + 1:]
    at = next(i for i, piece in enumerate(queue) if piece[0] == name)
    return queue[at], queue[:at] + queue[at + 1:]


def _no_room(name: str, obj: Any, size: int, planner: _Planner) -> Exception:
    """The error for a piece that fits nowhere: the layer too large for where offloaded layers
    run, the piece too large for every device, or the model too large for ``max_memory``."""
    budgets = planner.budgets
    homes = [d for d in planner.devices if d in planner.keeps_room]
    if homes and planner.layer > max(budgets[d] for d in homes):
        home = max(homes, key=lambda d: budgets[d])
        layer = planner.layer_names[0]
        return _too_big(layer, _named(planner.model, layer), planner.layer, home, budgets[home],
                        f": offloaded layers are brought to {home!r} one at a time to run")
    kept = {d: planner.layer if d in planner.keeps_room else 0 for d in planner.devices}
    caps = {d: budgets[d] - kept[d] for d in planner.devices}
    best = max(caps, key=lambda d: caps[d])
    if size > caps[best]:
        note = f" ({_mb(kept[best])} of it kept for offloaded layers)" if kept[best] else ""
        return _too_big(name, obj, size, best, caps[best], note)
    left = size + sum(planner.sizes.get(n, 0) for n, _ in planner.queue)
    total = sum(v for v in budgets.values() if v != math.inf)
    return _error(f"the model ({_mb(planner.sizes[''])}) does not fit in max_memory ({_mb(total)} over "
                  f"{', '.join(map(repr, planner.devices))}): '{name}' ({_kind(obj)}, {_mb(size)}) and what follows "
                  f"it ({_mb(left)} in all) are left over. Raise max_memory by at least {_mb(left)}, {_FIX_DISK}")


_FIX_DISK = "or pass offload_folder= so that what fits nowhere is offloaded to disk"


def _too_big(name: str, obj: Any, size: float, device: Any, cap: float, note: str) -> Exception:
    why = ("its class is in no_split_module_classes" if isinstance(obj, nn.Module) and next(obj.children(), None)
           is not None else "it has no submodules to split")
    return _error(f"module '{name}' ({_kind(obj)}, {_mb(size)}) cannot be split ({why}) and is larger than any "
                  f"device's share of max_memory: the largest is {device!r} with {_mb(cap)}{note}, "
                  f"{_mb(size - cap)} short. Raise max_memory[{device!r}] by at least {_mb(size - cap)}, {_FIX_DISK}")


def _kind(obj: Any) -> str:
    return type(obj).__name__ if isinstance(obj, nn.Module) else "tensor"


def _named(model: nn.Module, name: str) -> Any:
    """The submodule or tensor of ``model`` called ``name``."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return getattr(module, leaf) if leaf else module


__all__ = ["CPU", "DISK", "get_balanced_memory", "infer_auto_device_map"]
