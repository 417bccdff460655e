"""Module hooks: the one machinery behind dispatched and offloaded models.

These are the objects Accelerate's ``accelerate.hooks`` defines, with its semantics, because
transformers, peft and diffusers build, subclass and read them: a :class:`ModelHook` sits in
``module._hf_hook``; :func:`add_hook_to_module` replaces ``module.forward`` by a function that
calls ``hook.pre_forward(module, *args, **kwargs)``, the original forward (kept as
``module._old_forward``) and ``hook.post_forward(module, output)``.

:class:`AlignDevicesHook` is what ``dispatch_model``, ``cpu_offload`` and ``disk_offload``
attach (hook_placement.py puts them on a model's modules): inputs go to ``execution_device``; with ``offload`` the module's own tensors wait as
meta placeholders and come from ``weights_map`` (a cpu state dict, or an
:class:`~torchbay.offload_index.OffloadedWeightsLoader` reading the disk) while the module
runs. Two refinements over Accelerate, both invisible to its callers: a module called again
from inside its own forward keeps what it loaded, and a tied weight whose home is another
device is lent for the forward (the tie survives; docs/big-model-inference.md).

Differences from Accelerate, chosen: removing an offloading hook puts weights that waited on
disk back as real cpu tensors (Accelerate leaves them on the meta device), so the module runs
as a plain module again; a weight replaced while hooked (a new checkpoint loaded) is kept.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torchbay.device_map import named_module_tensors
from torchbay.operations import find_device, send_to_device

_CPU = torch.device("cpu")


def _not_traced(method):
    """Keep torch.compile out of a hook's work (moving weights is not part of the model's graph), as
    Accelerate does; ``torch.compiler.disable`` is applied only once dynamo is loaded, since loading it
    takes seconds and a process that never compiles never needs it."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return method(*args, **kwargs)
        if "disabled" not in wrapper.__dict__:
            wrapper.disabled = torch.compiler.disable(method)
        return wrapper.disabled(*args, **kwargs)

    return wrapper


# --- the hook protocol ---------------------------------------------------------------------


class ModelHook:
    """Callbacks around a module's forward; subclass and override what you need.

    ``no_grad = True`` runs the forward under ``torch.no_grad()``.
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Called before the forward; returns the (possibly changed) ``args, kwargs``."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the forward; returns the (possibly changed) output."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed."""
        return module

    def forward_failed(self, module: nn.Module) -> None:
        """torchbay: called instead of ``post_forward`` when the forward raised (Accelerate calls
        nothing); an offloading hook puts its placeholders back."""


class SequentialHook(ModelHook):
    """Several hooks run one after the other (``add_hook_to_module(..., append=True)`` builds it)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = hooks

    def init_hook(self, module):
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    @_not_traced
    def pre_forward(self, module, *args, **kwargs):
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    @_not_traced
    def post_forward(self, module, output):
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module):
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module

    def forward_failed(self, module):
        for hook in self.hooks:
            getattr(hook, "forward_failed", lambda m: None)(module)


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    hook = module._hf_hook
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    try:
        with torch.no_grad() if hook.no_grad else contextlib.nullcontext():
            output = module._old_forward(*args, **kwargs)
    except BaseException:
        getattr(hook, "forward_failed", lambda m: None)(module)
        raise
    return module._hf_hook.post_forward(module, output)


def _is_graph_module(module: nn.Module) -> bool:
    # a torch.fx GraphModule's forward is set on its class: an instance attribute would freeze the graph
    return "GraphModuleImpl" in str(type(module))


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module`` (replacing its hook, or chained after it with ``append``)."""
    if append and getattr(module, "_hf_hook", None) is not None:
        previous = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(previous, hook)
    if not (hasattr(module, "_hf_hook") and hasattr(module, "_old_forward")):
        module._old_forward = module.forward
    old_forward = module._old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook
    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), old_forward)
    if _is_graph_module(module):
        module.__class__.forward = forward
    else:
        module.forward = forward
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (and, with ``recurse``, of every submodule) and give its
    forward back."""
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        if _is_graph_module(module):
            module.__class__.forward = module._old_forward
        else:
            module.forward = module._old_forward
        delattr(module, "_old_forward")
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Detach the hooks of ``module`` and of all its submodules."""
    remove_hook_from_module(module, recurse=True)


# --- moving tensors in and out -------------------------------------------------------------


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


# --- aligning devices ----------------------------------------------------------------------


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

    @_not_traced
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
        device = self.execution_device if self.execution_device is not None else _CPU
        for name in self.offloaded_names(module):
            placeholder = self._placeholders.get(name)
            if placeholder is None:  # a module whose tensors changed after the hook was attached
                placeholder = self._placeholders[name] = _meta(_current(module, name))
            _put(module, name, _to(self.weights_map[name], device, placeholder), like=placeholder)
        for name, home in self.lent.items():
            _put(module, name, home.to(device), like=home)

    @_not_traced
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
            original = self.original_devices.get(name, _CPU)
            device = _CPU if original.type == "meta" else original
            _put(module, name, _to(value, device, placeholder if placeholder is not None else value),
                 like=placeholder)
        return module


# --- whole-model offload to the cpu between calls ------------------------------------------


class CpuOffload(ModelHook):
    """The whole model waits on the cpu and moves to ``execution_device`` when it runs, and stays
    there; chained with ``prev_module_hook``, running this model first offloads that one."""

    def __init__(self, execution_device: int | str | torch.device | None = None,
                 prev_module_hook: "UserCpuOffloadHook | None" = None):
        self.prev_module_hook = prev_module_hook
        self.execution_device = execution_device if execution_device is not None else _default_device()

    def init_hook(self, module):
        return module.to("cpu")

    @_not_traced
    def pre_forward(self, module, *args, **kwargs):
        previous = self.prev_module_hook
        if isinstance(previous, UserCpuOffloadHook):
            first = next(previous.model.parameters(), None)
            if first is not None and first.device != _CPU:
                previous.offload()
        first = next(module.parameters(), None)
        if first is not None and first.device == torch.device(self.execution_device):
            return args, kwargs
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def _default_device() -> torch.device:
    """The device a run uses: the running Accelerator's, else the accelerator big-model
    placement uses (device index 0), else the cpu."""
    from torchbay.device_map import accelerator_class

    cls = accelerator_class()
    return torch.device(cls.torch_type(), 0) if cls is not None else _CPU


class UserCpuOffloadHook:
    """What :func:`~torchbay.big_modeling.cpu_offload_with_hook` returns: ``offload()`` sends the
    model back to the cpu, ``remove()`` takes the hook off."""

    def __init__(self, model: nn.Module, hook: ModelHook):
        self.model, self.hook = model, hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


class LayerwiseCastingHook(ModelHook):
    """Weights stored in ``storage_dtype`` and cast to ``compute_dtype`` for each forward."""

    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool):
        self.storage_dtype, self.compute_dtype, self.non_blocking = storage_dtype, compute_dtype, non_blocking

    def init_hook(self, module):
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    @_not_traced
    def pre_forward(self, module, *args, **kwargs):
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    @_not_traced
    def post_forward(self, module, output):
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


# --- questions and temporary alignment -------------------------------------------------------


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


__all__ = ["AlignDevicesHook", "CpuOffload", "LayerwiseCastingHook", "ModelHook", "SequentialHook",
           "UserCpuOffloadHook", "add_hook_to_module", "align_module_device", "has_offloaded_params",
           "remove_hook_from_module", "remove_hook_from_submodules"]
