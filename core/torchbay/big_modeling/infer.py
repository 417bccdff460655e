"""Choosing a device map: ``infer_auto_device_map`` and ``get_balanced_memory``.

Placement walks the model in definition order and fills each device of ``max_memory`` in
turn (accelerator indexes, then ``"cpu"``, then ``"disk"``). A module that does not fit in
what is left of the current device is split into its own tensors and children; one that
cannot be split (no children, or a class in ``no_split_module_classes``) moves on to the
next device. A module that shares a tied weight with one just placed is placed next (on the
same device when it fits). When the devices that run modules (the accelerators, else the
cpu) cannot hold the whole model, the first one keeps room for the largest unsplittable
layer: offloaded layers are brought there one at a time to run.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any

from torch import nn

from torchbay.big_modeling.device_map import (
    CPU,
    DISK,
    _error,
    _splittable,
    _units,
    compute_module_sizes,
    find_tied_parameters,
    get_max_layer_size,
    get_max_memory,
    group_device_map,
)

log = logging.getLogger("torchbay")


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
    """A device map for ``model`` within ``max_memory`` (default: what the device plugins report).

    ``offload_to_disk``: ``None`` (Accelerate's behaviour) lets what fits nowhere go to
    ``"disk"``; ``False`` raises a :class:`~torchbay.errors.ConfigError` instead, naming the
    module that does not fit and by how much (``load_checkpoint_and_dispatch`` passes ``False``
    without an ``offload_folder``). ``offload_buffers`` and ``fallback_allocation`` are accepted
    for Accelerate's signature: buffers are counted with their module, and a module that does
    not fit is always split before a device is left.
    """
    budgets = dict(get_max_memory(max_memory))
    no_split = set(no_split_module_classes or [])
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    devices = list(budgets)
    if DISK not in budgets and offload_to_disk is not False:
        devices.append(DISK)
        budgets[DISK] = math.inf
    accelerators = [d for d in devices if isinstance(d, int)]
    runs_on = accelerators or [d for d in devices if d == CPU]  # where modules run (the others are offloaded)
    reserve: dict[Any, int] = {}
    layer, layer_names = get_max_layer_size(_units(model, ""), sizes, list(no_split))
    offload_to = [d for d in devices if d not in runs_on]
    if runs_on and offload_to and sizes[""] > sum(budgets[d] for d in runs_on):
        reserve[runs_on[0]] = layer  # offloaded layers are brought there to run, one at a time
        if verbose:
            log.info("keeping %s on %s for offloaded layers (largest: %s)", _mb(layer), runs_on[0],
                     ", ".join(layer_names))
    ties = find_tied_parameters(model)
    queue = _units(model, "")
    placed: dict[str, Any] = {}
    used: dict[Any, float] = defaultdict(int)
    index = 0
    while queue:
        name, obj = queue.pop(0)
        size = sizes.get(name, 0)
        while True:
            device = devices[index]
            room = budgets[device] - reserve.get(device, 0) - used[device]
            if size <= room:
                placed[name] = device
                used[device] += size
                if verbose:
                    log.info("%s (%s) -> %s", name or "<model>", _mb(size), device)
                queue = _tied_next(name, ties, queue)
                break
            if isinstance(obj, nn.Module) and _splittable(obj, no_split):
                queue = _units(obj, name) + queue
                break
            if index + 1 == len(devices):
                raise _no_room(name, obj, size, budgets, reserve, devices, sizes, placed)
            index += 1
        if placed.get(name) == DISK and size > max(
                (budgets[d] - reserve.get(d, 0) for d in devices if d != DISK), default=0) and verbose:
            log.info("%s (%s) fits on no device of max_memory: it goes to disk", name, _mb(size))
    return group_device_map(placed, model) if clean_result else placed


def _under(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


def _tied_next(name: str, ties: list[list[str]], queue: list) -> list:
    """Bring forward the units that share a tied weight with ``name``, so that they land on the
    same device (a tied head placed elsewhere would copy the weight there at every forward)."""
    partners = [other for group in ties if any(_under(n, name) for n in group)
                for other in group if not _under(other, name)]
    if not partners:
        return queue
    first = [item for item in queue if any(_under(other, item[0]) for other in partners)]
    return first + [item for item in queue if item not in first]


def _no_room(name: str, obj: Any, size: int, budgets, reserve, devices, sizes, placed) -> Exception:
    """The error for a module that fits nowhere: which, how big, and the shortfall."""
    kind = type(obj).__name__ if isinstance(obj, nn.Module) else "tensor"
    caps = {d: budgets[d] - reserve.get(d, 0) for d in devices}
    best = max(caps, key=lambda d: caps[d])
    why = ("its class is in no_split_module_classes" if isinstance(obj, nn.Module) and next(obj.children(), None)
           is not None else "it has no submodules to split")
    fix_disk = "or pass offload_folder= so that what fits nowhere is offloaded to disk"
    if size > caps[best]:
        kept = f" ({_mb(reserve[best])} of it kept for offloaded layers)" if reserve.get(best) else ""
        return _error(f"module '{name}' ({kind}, {_mb(size)}) cannot be split ({why}) and is larger than any "
                      f"device's share of max_memory: the largest is {best!r} with {_mb(caps[best])}{kept}, "
                      f"{_mb(size - caps[best])} short. Raise max_memory[{best!r}] by at least "
                      f"{_mb(size - caps[best])}, {fix_disk}")
    left = sizes[""] - sum(sizes.get(n, 0) for n in placed)
    total = sum(v for v in budgets.values() if v != math.inf)
    return _error(f"the model ({_mb(sizes[''])}) does not fit in max_memory ({_mb(total)} over "
                  f"{', '.join(map(repr, devices))}): '{name}' ({kind}, {_mb(size)}) and what follows it "
                  f"({_mb(left)} in all) are left over. Raise max_memory by at least {_mb(left)}, {fix_disk}")


__all__ = ["CPU", "DISK", "get_balanced_memory", "infer_auto_device_map"]
