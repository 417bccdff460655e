"""The forward hooks of a dispatched model: inputs to the right device, offloaded weights in.

Each placed module gets one :class:`DispatchHook`, attached with torch's own forward hooks
(``register_forward_pre_hook`` / ``register_forward_hook(always_call=True)``), so nothing
replaces the module's ``forward``. Before the forward, the hook moves the inputs to the
module's execution device and *borrows* the tensors that live elsewhere: an offloaded weight
(kept on the cpu or read from a safetensors file on disk) or a tied weight whose home is on
another device. After the forward (even a failed one) it puts the placeholders back, so an
offloaded weight occupies the execution device only while its module runs. The model's own
hook (the root) moves the outputs back to the device the inputs came from.

:func:`remove_hook_from_module` undoes it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from torchbay.operations import send_to_device

ATTR = "_torchbay_dispatch"


# --- where a borrowed tensor comes from ------------------------------------------------------


class TensorSource:
    """A tensor kept on another device (the cpu for cpu offload, or a tied weight's home)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def load(self, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.tensor.to(device=device, dtype=dtype or self.tensor.dtype, non_blocking=False)


class FileSource:
    """One tensor of a safetensors file, read (memory-mapped) when needed, converted to ``dtype``.

    The most recently used file stays open; an older one is closed, so that the pages of
    offloaded weights leave the process once their modules have run.
    """

    _handles: "OrderedDict[tuple, Any]" = OrderedDict()
    _keep = 1
    _lock = threading.Lock()

    def __init__(self, path: str | Path, key: str, dtype: torch.dtype | None = None):
        self.path, self.key, self.dtype = str(path), key, dtype

    @classmethod
    def handle(cls, path: str):
        from safetensors import safe_open

        info = os.stat(path)
        key = (path, info.st_ino, info.st_size, info.st_mtime_ns)  # a file written again is opened again
        with cls._lock:
            if key not in cls._handles:
                cls._handles[key] = safe_open(path, framework="pt", device="cpu")
                while len(cls._handles) > cls._keep:
                    cls._handles.popitem(last=False)
            cls._handles.move_to_end(key)
            return cls._handles[key]

    def load(self, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self.handle(self.path).get_tensor(self.key)  # a view of the mapped file: no copy yet
        dtype = dtype or self.dtype
        if dtype is not None and tensor.is_floating_point():
            return tensor.to(device=device, dtype=dtype)
        return tensor.to(device=device)

    def describe(self) -> dict[str, Any]:
        return {"file": self.path, "key": self.key, "dtype": str(self.dtype).replace("torch.", "") if self.dtype
                else None}


# --- the hook ------------------------------------------------------------------------------


class Borrowed:
    """Tensor ``name`` of ``owner`` (a parameter or a buffer), filled from ``source`` while it runs."""

    __slots__ = ("owner", "name", "is_param", "source", "placeholder")

    def __init__(self, owner: nn.Module, name: str, source: Any):
        self.owner, self.name, self.source = owner, name, source
        self.is_param = name in owner._parameters
        self.placeholder = owner._parameters[name] if self.is_param else owner._buffers[name]

    def fill(self, device: torch.device) -> None:
        tensor = self.source.load(device, self.placeholder.dtype)
        if self.is_param:
            self.owner._parameters[self.name] = nn.Parameter(tensor, requires_grad=False)
        else:
            self.owner._buffers[self.name] = tensor

    def empty(self) -> None:
        if self.is_param:
            self.owner._parameters[self.name] = self.placeholder
        else:
            self.owner._buffers[self.name] = self.placeholder


class DispatchHook:
    """What one module of a dispatched model does around its forward (see the module doc)."""

    def __init__(self, execution_device: torch.device | None, borrowed: Iterable[Borrowed] = (), *,
                 io_same_device: bool = False, skip_keys: str | list[str] | None = None,
                 move_inputs: bool = True):
        self.execution_device = execution_device
        self.borrowed = list(borrowed)
        self.io_same_device = io_same_device
        self.skip_keys = skip_keys
        self.move_inputs = move_inputs and execution_device is not None
        self.handles: list[Any] = []
        self._input_devices: list[torch.device | None] = []
        self._depth = 0

    @property
    def offloaded(self) -> bool:
        return any(not isinstance(b.source, TensorSource) or b.placeholder.device.type == "meta"
                   for b in self.borrowed)

    def attach(self, module: nn.Module) -> None:
        if getattr(module, ATTR, None) is not None:
            remove_hook_from_module(module)
        self.handles = [module.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
                        module.register_forward_hook(self.post_forward, with_kwargs=True, always_call=True)]
        setattr(module, ATTR, self)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.io_same_device:
            self._input_devices.append(_first_device((args, kwargs)))
        self._depth += 1
        if self._depth == 1:  # a module called again from its own forward keeps what it borrowed
            for item in self.borrowed:
                item.fill(self.execution_device)
        if self.move_inputs:
            args = send_to_device(args, self.execution_device)
            kwargs = send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        self._depth -= 1
        if self._depth == 0:
            for item in self.borrowed:
                item.empty()
        if self.io_same_device and self._input_devices:
            device = self._input_devices.pop()
            if device is not None:
                return send_to_device(output, device, skip_keys=self.skip_keys)
        return output

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _first_device(data: Any) -> torch.device | None:
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, dict):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        for item in data:
            found = _first_device(item)
            if found is not None:
                return found
    return None


def add_hook_to_module(module: nn.Module, hook: DispatchHook) -> nn.Module:
    hook.attach(module)
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Take off torchbay's dispatch hook (and, with ``recurse``, those of every submodule).

    Borrowed weights are put back as real tensors on the cpu (offloaded ones are read from
    their source) so that the module runs as a plain module again; weights already placed on
    a device stay there. ``model.hf_device_map`` is left as it was.
    """
    modules = list(module.modules()) if recurse else [module]
    for sub in modules:
        hook = getattr(sub, ATTR, None)
        if hook is None:
            continue
        hook.detach()
        cpu = torch.device("cpu")
        for item in hook.borrowed:
            current = (item.owner._parameters if item.is_param else item.owner._buffers).get(item.name)
            if current is not item.placeholder:
                continue  # replaced since it was dispatched (a new checkpoint loaded): keep the new tensor
            if item.placeholder.device.type == "meta":
                item.placeholder = _as_kind(item, item.source.load(cpu, item.placeholder.dtype))
            item.empty()
        delattr(sub, ATTR)
    return module


def _as_kind(item: Borrowed, tensor: torch.Tensor) -> torch.Tensor:
    return nn.Parameter(tensor, requires_grad=item.placeholder.requires_grad) if item.is_param else tensor


def remove_hook_from_submodules(module: nn.Module) -> None:
    remove_hook_from_module(module, recurse=True)


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` has a dispatch hook that brings in offloaded weights."""
    hook = getattr(module, ATTR, None)
    return hook is not None and hook.offloaded


class align_module_device:
    """Context manager: the module's offloaded weights are present on ``execution_device``
    (default: its hook's) inside the block, as during its forward."""

    def __init__(self, module: nn.Module, execution_device: torch.device | None = None):
        self.module, self.device = module, execution_device

    def __enter__(self) -> nn.Module:
        hook = getattr(self.module, ATTR, None)
        self.items = hook.borrowed if hook is not None else []
        device = self.device or (hook.execution_device if hook is not None else None)
        for item in self.items:
            item.fill(device)
        if hook is None and self.device is not None:
            self.moved = {n: t.device for n, t in self.module.named_parameters(recurse=False)}
            for name in self.moved:
                self.module._parameters[name].data = self.module._parameters[name].data.to(self.device)
        return self.module

    def __exit__(self, *exc: Any) -> None:
        for item in self.items:
            item.empty()
        for name, device in getattr(self, "moved", {}).items():
            self.module._parameters[name].data = self.module._parameters[name].data.to(device)
