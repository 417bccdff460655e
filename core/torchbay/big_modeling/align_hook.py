"""Accelerate's ``AlignDevicesHook``: a module's weights put on its execution device for the forward (from the cpu,
from an offload folder or a checkpoint through ``weights_map``) and sent back after it, and the helpers built on it
(``has_offloaded_params``, ``align_module_device``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torchbay.big_modeling.device_map import named_module_tensors
from torchbay.big_modeling.hooks import CPU_DEVICE, ModelHook, not_traced
from torchbay.data.operations import find_device, send_to_device


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner) if owner else module), leaf


def _current(module: nn.Module, name: str) -> torch.Tensor:
    owner, leaf = _owner(module, name)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def _put(module: nn.Module, name: str, value: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """Set tensor ``name`` of ``module`` to ``value`` (a parameter stays a parameter)."""
    owner, leaf = _owner(module, name)
    if leaf in owner._parameters:
        if not isinstance(value, nn.Parameter):
            grad = (like if like is not None else owner._parameters[leaf]).requires_grad
            value = nn.Parameter(value, requires_grad=grad and value.is_floating_point())
        owner._parameters[leaf] = value
    else:
        owner._buffers[leaf] = value


def _to(value: torch.Tensor, device: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` on ``device`` in the dtype of the tensor it stands for (floating point only)."""
    if value.is_floating_point() and like.is_floating_point() and value.dtype != like.dtype:
        return value.to(device=device, dtype=like.dtype)
    return value.to(device)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(placeholder, requires_grad=tensor.requires_grad)
    return placeholder


class AlignDevicesHook(ModelHook):
    """Inputs and weights on ``execution_device`` for the forward; with ``offload``, the weights
    come from ``weights_map`` and leave again after it (see the module doc).

    ``io_same_device``: the output goes back to the device of the input.
    ``offload_buffers``: buffers are offloaded too. ``place_submodules``: the submodules'
    tensors are handled by this hook as well. ``skip_keys``: keyword arguments left where they
    are. ``tied_params_map`` is accepted for Accelerate's signature: ties are kept by lending
    the tied weight instead.
    """

    def __init__(self, execution_device: int | str | torch.device | None = None, offload: bool = False,
                 io_same_device: bool = False, weights_map: Mapping | None = None, offload_buffers: bool = False,
                 place_submodules: bool = False, skip_keys: str | list[str] | None = None,
                 tied_params_map: dict | None = None):
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.input_device = None
        self.original_devices: dict[str, torch.device] = {}
        self.lent: dict[str, torch.Tensor] = {}  # name -> a tied weight whose home is another device
        self._placeholders: dict[str, torch.Tensor] = {}
        self._depth = 0

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
                f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
                f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})")

    def offloaded_names(self, module: nn.Module) -> list[str]:
        """The tensors this hook brings in for each forward (none without ``offload``)."""
        if not self.offload:
            return []
        return [name for name, _ in named_module_tensors(module, include_buffers=self.offload_buffers,
                                                         recurse=self.place_submodules, remove_non_persistent=True)
                if name not in self.lent]

    def init_hook(self, module):
        device = self.execution_device
        if not self.offload:
            if device is not None:
                for name, tensor in list(named_module_tensors(module, recurse=self.place_submodules)):
                    if name not in self.lent and tensor.device != torch.device(device):
                        _put(module, name, tensor.to(device), like=tensor)
            return module
        tensors = dict(named_module_tensors(module, recurse=self.place_submodules))
        self.original_devices = {name: tensor.device for name, tensor in tensors.items()}
        names = self.offloaded_names(module)
        if self.weights_map is None:
            self.weights_map = {name: tensor.to("cpu") for name, tensor in named_module_tensors(
                module, include_buffers=self.offload_buffers, recurse=self.place_submodules)}
        self._placeholders = {}
        for name in names:
            tensor = tensors[name]
            self._placeholders[name] = tensor if tensor.is_meta else _meta(tensor)
            _put(module, name, self._placeholders[name])
        if device is not None:  # what is not offloaded runs where the module runs
            for name, tensor in tensors.items():
                if name not in self._placeholders and name not in self.lent and tensor.device != torch.device(device):
                    _put(module, name, tensor.to(device), like=tensor)
        return module

    @not_traced
    def pre_forward(self, module, *args, **kwargs):
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        self._depth += 1
        if self._depth == 1:  # a module called again from its own forward keeps what it loaded
            self._bring_in(module)
        if self.execution_device is None:
            return args, kwargs
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys))

    def _bring_in(self, module: nn.Module) -> None:
        device = self.execution_device if self.execution_device is not None else CPU_DEVICE
        for name in self.offloaded_names(module):
            placeholder = self._placeholders.get(name)
            if placeholder is None:  # a module whose tensors changed after the hook was attached
                placeholder = self._placeholders[name] = _meta(_current(module, name))
            _put(module, name, _to(self.weights_map[name], device, placeholder), like=placeholder)
        for name, home in self.lent.items():
            _put(module, name, home.to(device), like=home)

    @not_traced
    def post_forward(self, module, output):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            for name in self.offloaded_names(module):
                placeholder = self._placeholders.get(name)
                _put(module, name, placeholder if placeholder is not None else _meta(_current(module, name)))
            for name, home in self.lent.items():
                _put(module, name, home)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def forward_failed(self, module):
        self._depth = 1
        self.post_forward(module, None)

    def detach_hook(self, module):
        for name, home in self.lent.items():
            _put(module, name, home)
        if not self.offload:
            return module
        for name in self.offloaded_names(module):
            placeholder = self._placeholders.get(name)
            if placeholder is not None and _current(module, name) is not placeholder:
                continue  # replaced while hooked (a new checkpoint loaded): keep the new tensor
            value = self.weights_map.get(name) if isinstance(self.weights_map, Mapping) else None
            if value is None:
                continue
            original = self.original_devices.get(name, CPU_DEVICE)
            device = CPU_DEVICE if original.type == "meta" else original
            _put(module, name, _to(value, device, placeholder if placeholder is not None else value),
                 like=placeholder)
        return module


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` has an :class:`AlignDevicesHook` that offloads its weights."""
    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and hook.offload


class align_module_device:
    """Context manager: the module's weights are present on ``execution_device`` (default: its
    hook's) inside the block, as during its forward."""

    def __init__(self, module: nn.Module, execution_device: Any = None):
        self.module, self.device = module, execution_device

    def __enter__(self) -> nn.Module:
        self.moved: dict[str, torch.device] = {}
        if has_offloaded_params(self.module):
            hook = self.module._hf_hook
            self.original = hook.execution_device
            if self.device is not None:
                hook.execution_device = self.device
            hook.pre_forward(self.module)
        elif self.device is not None:
            self.moved = {n: t.device for n, t in self.module.named_parameters(recurse=False)}
            for name in self.moved:
                _put(self.module, name, _current(self.module, name).to(self.device))
        return self.module

    def __exit__(self, *exc: Any) -> None:
        if has_offloaded_params(self.module):
            hook = self.module._hf_hook
            hook.post_forward(self.module, None)
            hook.execution_device = self.original
        for name, device in self.moved.items():
            _put(self.module, name, _current(self.module, name).to(device))


__all__ = ["AlignDevicesHook", "align_module_device", "has_offloaded_params"]
