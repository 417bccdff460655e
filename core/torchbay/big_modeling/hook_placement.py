"""Where a model's hooks go: Accelerate's ``attach_*`` functions, on torchbay's hook objects.

``cpu_offload`` and ``disk_offload`` use :func:`attach_align_device_hook`; ``dispatch_model`` places its
own hooks and then :func:`attach_execution_device_hook`, as Accelerate's ``dispatch_model`` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torchbay.big_modeling.align_hook import AlignDevicesHook
from torchbay.big_modeling.device_map import (
    named_module_tensors,
    torch_device,
)
from torchbay.big_modeling.hooks import LayerwiseCastingHook, add_hook_to_module
from torchbay.big_modeling.loading import Slot
from torchbay.big_modeling.offload_index import PrefixedDataset


def attach_execution_device_hook(module: nn.Module, execution_device: int | str | torch.device,
                                 skip_keys: str | list[str] | None = None,
                                 preload_module_classes: list[str] | None = None,
                                 tied_params_map: dict | None = None) -> None:
    """An input-moving :class:`AlignDevicesHook` on every submodule that holds tensors and no hook."""
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys,
                                                    tied_params_map=tied_params_map))
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys=skip_keys,
                                     preload_module_classes=preload_module_classes, tied_params_map=tied_params_map)


def attach_align_device_hook(module: nn.Module, execution_device: int | str | torch.device | None = None,
                             offload: bool = False, weights_map: Mapping | None = None,
                             offload_buffers: bool = False, module_name: str = "",
                             skip_keys: str | list[str] | None = None,
                             preload_module_classes: list[str] | None = None,
                             tied_params_map: dict | None = None) -> None:
    """An :class:`AlignDevicesHook` on every submodule with tensors of its own (a module of a
    ``preload_module_classes`` class takes its whole subtree), reading ``weights_map`` under
    the submodule's name."""
    has_tensors = next(iter(named_module_tensors(module)), None) is not None
    full = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if has_tensors or full:
        prefixed = None
        if weights_map is not None:
            prefixed = PrefixedDataset(weights_map, f"{module_name}." if module_name else "")
        add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device, offload=offload,
                                                    weights_map=prefixed, offload_buffers=offload_buffers,
                                                    place_submodules=full, skip_keys=skip_keys,
                                                    tied_params_map=tied_params_map), append=True)
    if full:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(child, execution_device=execution_device, offload=offload, weights_map=weights_map,
                                 offload_buffers=offload_buffers,
                                 module_name=f"{module_name}.{child_name}" if module_name else child_name,
                                 skip_keys=skip_keys, preload_module_classes=preload_module_classes,
                                 tied_params_map=tied_params_map)


def attach_align_device_hook_on_blocks(module: nn.Module, execution_device: Any = None,
                                       offload: bool | dict[str, bool] = False, weights_map: Mapping | None = None,
                                       offload_buffers: bool = False, module_name: str = "",
                                       skip_keys: str | list[str] | None = None,
                                       preload_module_classes: list[str] | None = None,
                                       tied_params_map: dict | None = None) -> None:
    """Hooks for blocks: ``execution_device`` and ``offload`` are one value for the whole
    module, or dicts ``{block name: value}``; an offloaded block gets
    :func:`attach_align_device_hook`, a placed one a single hook for its subtree."""
    common = dict(skip_keys=skip_keys, tied_params_map=tied_params_map)
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if not offload:
            add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device, io_same_device=True,
                                                        place_submodules=True, **common))
        else:
            attach_align_device_hook(module, execution_device=execution_device, offload=True,
                                     weights_map=weights_map, offload_buffers=offload_buffers,
                                     module_name=module_name, **common)
        return
    if not isinstance(execution_device, Mapping):
        execution_device = {key: execution_device for key in offload}
    if not isinstance(offload, Mapping):
        offload = {key: offload for key in execution_device}
    root = module_name == ""
    if module_name in execution_device and module_name in offload and not offload[module_name]:
        add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device[module_name],
                                                    offload_buffers=offload_buffers, io_same_device=root,
                                                    place_submodules=True, **common))
        attach_execution_device_hook(module, execution_device[module_name], **common)
    elif module_name in execution_device and module_name in offload:
        attach_align_device_hook(module, execution_device=execution_device[module_name], offload=True,
                                 weights_map=weights_map, offload_buffers=offload_buffers, module_name=module_name,
                                 preload_module_classes=preload_module_classes, **common)
        if not hasattr(module, "_hf_hook"):
            add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device[module_name],
                                                        io_same_device=root, **common))
        attach_execution_device_hook(module, execution_device[module_name],
                                     preload_module_classes=preload_module_classes, **common)
    elif root:
        add_hook_to_module(module, AlignDevicesHook(execution_device=execution_device.get(""), io_same_device=True,
                                                    **common))
    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(child, execution_device=execution_device, offload=offload,
                                           weights_map=weights_map, offload_buffers=offload_buffers,
                                           module_name=f"{module_name}.{child_name}" if module_name else child_name,
                                           preload_module_classes=preload_module_classes, **common)


#: the layers attach_layerwise_casting_hooks casts (Accelerate's constant of the same name)
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                                          nn.ConvTranspose3d, nn.Linear)


def attach_layerwise_casting_hooks(module: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
                                   skip_modules_pattern: str | tuple[str, ...] | None = None,
                                   skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
                                   non_blocking: bool = False) -> None:
    """Keep the weights of every linear and convolution layer in ``storage_dtype`` and run each in
    ``compute_dtype`` (a :class:`LayerwiseCastingHook` per layer), except the layers whose name matches
    a regular expression of ``skip_modules_pattern`` or whose class is in ``skip_modules_classes``."""
    _cast_layerwise(module, storage_dtype, compute_dtype, skip_modules_pattern, skip_modules_classes, non_blocking,
                    prefix="")


def _cast_layerwise(module, storage_dtype, compute_dtype, patterns, classes, non_blocking, prefix: str) -> None:
    if (classes is not None and isinstance(module, classes)) or (
            patterns is not None and any(re.search(p, prefix) for p in patterns)):
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        add_hook_to_module(module, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
        return
    for name, child in module.named_children():
        _cast_layerwise(child, storage_dtype, compute_dtype, patterns, classes, non_blocking,
                        f"{prefix}.{name}" if prefix else name)


def attach_dispatch_hooks(model, keys, main, offloaded, slots, home, loader, offload_buffers, skip_keys,
                          preload) -> None:
    """One :class:`AlignDevicesHook` per module that needs one: the root of each device-map
    entry, and every module that holds a tensor living elsewhere (offloaded, or a tie)."""
    owner_slots: dict[str, list[tuple[str, Slot]]] = {}
    for slot in slots:
        for name in slot.names:
            owner, _, leaf = name.rpartition(".")
            owner_slots.setdefault(owner, []).append((leaf, slot))

    def execution(place):
        return torch_device(main if place in offloaded else place)

    def away(module_name: str, device: torch.device) -> bool:  # does it hold a tensor that lives elsewhere?
        return any(home[id(slot)] != device for _, slot in owner_slots.get(module_name, []))

    exec_device: dict[str, torch.device] = {}
    offloading: set[str] = set()  # modules of an offloaded entry that hold tensors: offloading hooks, as Accelerate's
    for unit, place in keys.items():
        device = execution(place)
        module = _get(model, unit)
        if isinstance(module, nn.Module):
            exec_device.setdefault(unit, device)
            for rel, sub in module.named_modules():
                full = f"{unit}.{rel}" if unit and rel else unit or rel
                if place in offloaded and next(named_module_tensors(sub), None) is not None:
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
        offload = name in offloading or any(home[id(slot)] is None for slot in slot_of.values())
        hook = AlignDevicesHook(execution_device=device, offload=offload, io_same_device=(name == ""),
                                weights_map=PrefixedDataset(loader, f"{name}." if name else "") if offload else None,
                                offload_buffers=offload_buffers, place_submodules=whole, skip_keys=skip_keys)
        # a tensor placed on a device stays there: lent to this module for its forward when it lives elsewhere
        hook.lent = {rel: slot.tensor for rel, slot in slot_of.items()
                     if home[id(slot)] is not None and (offload or home[id(slot)] != device)}
        add_hook_to_module(module, hook)
    if "" not in exec_device:
        add_hook_to_module(model, AlignDevicesHook(torch_device(main), io_same_device=True, skip_keys=skip_keys))
    for unit, place in keys.items():  # as Accelerate: every module with tensors knows its execution device
        module = _get(model, unit)
        if isinstance(module, nn.Module):
            attach_execution_device_hook(module, execution(place), skip_keys=skip_keys, preload_module_classes=preload)


def _tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _get(model: nn.Module, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


__all__ = ["SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING", "attach_layerwise_casting_hooks", "attach_align_device_hook",
           "attach_align_device_hook_on_blocks", "attach_execution_device_hook"]
