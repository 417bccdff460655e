"""Where a model's hooks go: Accelerate's ``attach_*`` functions, on torchbay's hook objects.

``cpu_offload`` and ``disk_offload`` use :func:`attach_align_device_hook`; ``dispatch_model`` places its
own hooks (dispatch.py) and then :func:`attach_execution_device_hook`, as Accelerate's ``dispatch_model`` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torchbay.big_modeling.align_hook import AlignDevicesHook
from torchbay.big_modeling.device_map import named_module_tensors
from torchbay.big_modeling.hooks import LayerwiseCastingHook, add_hook_to_module
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


__all__ = ["SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING", "attach_layerwise_casting_hooks", "attach_align_device_hook",
           "attach_align_device_hook_on_blocks", "attach_execution_device_hook"]
