"""``dispatch_model``'s work in one pass: each tensor to its device, then the hooks that run the model there.

1. the device map gives each slot (a tensor object and all of its names, ``slots.py``) a place;
   a slot whose place is offloaded (``"disk"``, and ``"cpu"`` when an accelerator is the main
   device) waits there and its modules' hooks bring it to the main device while they run;
2. every value is checked before anything moves (a meta tensor needs a value; a disk tensor
   needs a file that holds it, or an offload folder to copy it into);
3. the values are put in place, the disk copies written, and, when the map has more than one
   place (or ``force_hooks``), one :class:`AlignDevicesHook` goes on each module that needs one.

A map with a single place other than ``"disk"`` moves the model there and attaches no hook, as
Accelerate. ``modeling.dispatch_model`` checks the map and calls :func:`dispatch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchbay.big_modeling.align_hook import AlignDevicesHook
from torchbay.big_modeling.device_map import CPU, DISK, device_key, device_of, named_module_tensors, torch_device
from torchbay.big_modeling.hook_placement import attach_execution_device_hook
from torchbay.big_modeling.hooks import add_hook_to_module, remove_hook_from_module
from torchbay.big_modeling.offload_index import INDEX as OFFLOAD_INDEX
from torchbay.big_modeling.offload_index import LEGACY_INDEX as LEGACY_OFFLOAD_INDEX
from torchbay.big_modeling.offload_index import (
    OFFLOADED,
    FileSource,
    OffloadedWeightsLoader,
    PrefixedDataset,
    read_offload_index,
    save_offload_index,
    write_offload,
)
from torchbay.big_modeling.slots import Slot, few, model_slots
from torchbay.errors import ConfigError


class Placement:
    """Where one ``dispatch_model`` call puts things: the device of each map entry, the main
    device, the places that are offloaded, and each slot's home (``None``: offloaded)."""

    def __init__(self, device_map: dict[str, Any], main_device: Any, force_hooks: bool):
        self.keys = {name: device_key(d) for name, d in device_map.items()}
        places = set(self.keys.values())
        self.hooked = force_hooks or len(places) != 1 or DISK in places
        main = device_key(main_device) if main_device is not None else None  # a wrong device is refused
        if not self.hooked:
            self.main = next(iter(places))  # one place: the model moves there, whatever main_device says
        else:
            self.main = main if main is not None else next((d for d in self.keys.values() if d not in (CPU, DISK)), CPU)
        self.offloaded = {DISK} if self.main == CPU else {CPU, DISK}
        self.home: dict[int, torch.device | None] = {}  # id(slot) -> its device, or None when offloaded

    def execution(self, place: Any) -> torch.device:
        """The device a module of ``place`` runs on."""
        return torch_device(self.main if place in self.offloaded else place)


def dispatch(model: nn.Module, device_map: dict[str, Any], main_device: Any = None, state_dict: dict | None = None,
             offload_dir: str | Path | None = None, offload_index: dict[str, Any] | None = None,
             offload_buffers: bool = False, skip_keys: str | list[str] | None = None,
             preload_module_classes: list[str] | None = None, force_hooks: bool = False) -> nn.Module:
    """Place ``model`` as the (checked) ``device_map`` says and attach its hooks; see the module doc."""
    where = Placement(device_map, main_device, force_hooks)
    remove_hook_from_module(model, recurse=True)
    slots, transient = model_slots(model)
    disk_entries = _disk_entries(model, offload_dir, offload_index) if where.hooked else {}
    plan = _plan(where, slots, transient, disk_entries, state_dict, offload_dir, offload_buffers)
    cpu_weights: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    pending: dict[str, Slot] = {}
    for slot, place, off in plan:
        where.home[id(slot)] = None if off else where.execution(place)
        if off and place == DISK:
            entry = next((disk_entries[n] for n in slot.names if n in disk_entries), None)
            if entry is None:
                pending[slot.names[0]] = slot
            else:
                index.update({n: entry for n in slot.names})
            continue
        device = torch_device(CPU) if off else where.home[id(slot)]
        value = slot.value(state_dict)
        if value is not slot.tensor or value.device != device:
            slot.assign(model, value.to(device))
        if off:
            cpu_weights.update({n: slot.tensor for n in slot.names})
    if pending:
        index.update(_write_to_disk(model, pending, offload_dir, state_dict))
    if where.hooked:
        loader = OffloadedWeightsLoader(state_dict=cpu_weights, save_folder=offload_dir, index=index)
        _attach_hooks(model, where, slots + transient, loader, offload_buffers, skip_keys, preload_module_classes or [])
    model.hf_device_map = dict(device_map)
    return model


def _plan(where: Placement, slots: list[Slot], transient: list[Slot], disk_entries: dict, state_dict: dict | None,
          offload_dir, offload_buffers: bool) -> list[tuple[Slot, Any, bool]]:
    """``(slot, place, offloaded)`` for every slot; raises, before anything changes, for a value that is missing."""
    plan, unresolved, no_folder = [], [], []
    transient_ids = {id(slot) for slot in transient}
    for slot in slots + transient:
        places = [device_of(n, where.keys) for n in slot.names]
        place = next((p for p in places if p not in where.offloaded), places[0])  # a tie lives where it runs
        off = place in where.offloaded and (slot.is_param or offload_buffers) and id(slot) not in transient_ids
        stored = off and place == DISK and any(n in disk_entries for n in slot.names)
        if not stored and slot.value(state_dict) is None:
            unresolved.append(" = ".join(slot.names))
        elif off and place == DISK and not stored and offload_dir is None:
            no_folder.append(slot.names[0])
        plan.append((slot, place, off))
    if unresolved:
        raise ConfigError(f"{len(unresolved)} tensor(s) are on the meta device and nothing gives their value: "
                          f"{', '.join(unresolved[:12])}; load a checkpoint (load_checkpoint_and_dispatch) or pass "
                          f"state_dict=", header="cannot dispatch the model")
    if no_folder:
        raise ConfigError(f"device_map puts {few(no_folder)} on 'disk' and no offload folder holds them: pass "
                          f"offload_dir= (a folder for their copies)", header="cannot offload to disk")
    return plan


def _write_to_disk(model: nn.Module, pending: dict[str, Slot], offload_dir, state_dict) -> dict[str, dict]:
    """Copy the disk-placed tensors no file holds yet into ``offload_dir``; their index entries."""
    written = write_offload(Path(offload_dir), {name: slot.value(state_dict) for name, slot in pending.items()})
    entries = {}
    for name, slot in pending.items():
        entries.update({n: written[name].entry() for n in slot.names})
        slot.assign(model, torch.empty(slot.tensor.shape, dtype=slot.tensor.dtype, device="meta"))
    save_offload_index(entries, offload_dir)
    return entries


def _disk_entries(model: nn.Module, offload_dir, offload_index) -> dict[str, dict]:
    """Where the weights that wait on disk are: Accelerate's offload index entries by name."""
    entries = {name: source.entry() for name, source in OFFLOADED.get(model, {}).items()}
    if offload_index:
        for name, entry in offload_index.items():
            entries[name] = _index_entry(name, entry, offload_dir)
    elif offload_dir is not None and not entries and any(
            (Path(offload_dir) / f).exists() for f in (OFFLOAD_INDEX, LEGACY_OFFLOAD_INDEX)):
        entries = read_offload_index(offload_dir)
    return entries


def _index_entry(name: str, entry: Any, offload_dir) -> dict:
    if isinstance(entry, FileSource):
        return entry.entry()
    if isinstance(entry, Mapping) and entry.get("safetensors_file") is not None:
        return dict(entry)
    if isinstance(entry, Mapping) and "dtype" in entry and "shape" in entry:
        if offload_dir is None:
            raise ConfigError(f"offload_index['{name}'] is a .dat entry of an offload folder: pass offload_dir= (the "
                              f"folder that holds {name}.dat)", header="cannot dispatch the model")
        return dict(entry)
    if isinstance(entry, Mapping) and "file" in entry and "key" in entry:  # torchbay's former index entries
        return FileSource(entry["file"], entry["key"]).entry()
    raise ConfigError(f"offload_index['{name}'] is {entry!r}: an entry is {{'safetensors_file', 'weight_name', "
                      f"'dtype'}} (a tensor of a safetensors file) or {{'dtype', 'shape'}} (a .dat file of "
                      f"offload_dir), as Accelerate writes them", header="cannot dispatch the model")


# --- the hooks --------------------------------------------------------------------------------


def _attach_hooks(model: nn.Module, where: Placement, slots: list[Slot], loader: OffloadedWeightsLoader,
                  offload_buffers: bool, skip_keys, preload: list[str]) -> None:
    """One :class:`AlignDevicesHook` per module that needs one: the root of each device-map
    entry, and every module that holds a tensor living elsewhere (offloaded, or a tie)."""
    owner_slots: dict[str, list[tuple[str, Slot]]] = {}
    for slot in slots:
        for name in slot.names:
            owner, _, leaf = name.rpartition(".")
            owner_slots.setdefault(owner, []).append((leaf, slot))

    def away(module_name: str, device: torch.device) -> bool:  # does it hold a tensor that lives elsewhere?
        return any(where.home[id(slot)] != device for _, slot in owner_slots.get(module_name, []))

    exec_device: dict[str, torch.device] = {}
    offloading: set[str] = set()  # modules of an offloaded entry that hold tensors: offloading hooks, as Accelerate's
    for unit, place in where.keys.items():
        device = where.execution(place)
        module = _get(model, unit)
        if isinstance(module, nn.Module):
            exec_device.setdefault(unit, device)
            for rel, sub in module.named_modules():
                full = f"{unit}.{rel}" if unit and rel else unit or rel
                if place in where.offloaded and next(named_module_tensors(sub), None) is not None:
                    offloading.add(full)
                    exec_device.setdefault(full, device)
                elif rel and away(full, device):
                    exec_device.setdefault(full, device)
        else:
            exec_device.setdefault(unit.rpartition(".")[0], device)
    for name, module in model.named_modules():
        if type(module).__name__ in preload and name in exec_device:
            for sub, _ in module.named_modules():
                if sub:
                    exec_device.pop(f"{name}.{sub}" if name else sub, None)
    by_name = {n: s for s in slots for n in s.names}
    for name, device in exec_device.items():
        module = model.get_submodule(name)
        whole = type(module).__name__ in preload
        tensors = [n for n, _ in _tensors(module)] if whole else [leaf for leaf, _ in owner_slots.get(name, [])]
        slot_of = {rel: by_name[f"{name}.{rel}" if name else rel] for rel in tensors
                   if (f"{name}.{rel}" if name else rel) in by_name}
        offload = name in offloading or any(where.home[id(slot)] is None for slot in slot_of.values())
        hook = AlignDevicesHook(execution_device=device, offload=offload, io_same_device=(name == ""),
                                weights_map=PrefixedDataset(loader, f"{name}." if name else "") if offload else None,
                                offload_buffers=offload_buffers, place_submodules=whole, skip_keys=skip_keys)
        # a tensor placed on a device stays there: lent to this module for its forward when it lives elsewhere
        hook.lent = {rel: slot.tensor for rel, slot in slot_of.items()
                     if where.home[id(slot)] is not None and (offload or where.home[id(slot)] != device)}
        add_hook_to_module(module, hook)
    if "" not in exec_device:
        add_hook_to_module(model, AlignDevicesHook(torch_device(where.main), io_same_device=True, skip_keys=skip_keys))
    for unit, place in where.keys.items():  # as Accelerate: every module with tensors knows its execution device
        module = _get(model, unit)
        if isinstance(module, nn.Module):
            attach_execution_device_hook(module, where.execution(place), skip_keys=skip_keys,
                                         preload_module_classes=preload)


def _tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _get(model: nn.Module, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


__all__ = ["Placement", "dispatch"]
