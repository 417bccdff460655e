"""Module hooks: the one machinery behind dispatched and offloaded models.

These are the objects Accelerate's ``accelerate.hooks`` defines, with its semantics, because
transformers, peft and diffusers build, subclass and read them: a :class:`ModelHook` sits in
``module._hf_hook``; :func:`add_hook_to_module` replaces ``module.forward`` by a function that
calls ``hook.pre_forward(module, *args, **kwargs)``, the original forward (kept as
``module._old_forward``) and ``hook.post_forward(module, output)``.

:class:`~torchbay.big_modeling.align_hook.AlignDevicesHook` is what ``dispatch_model``, ``cpu_offload`` and
``disk_offload`` attach (hook_placement.py puts them on a model's modules): inputs go to ``execution_device``; with
``offload`` the module's own tensors wait as meta placeholders and come from ``weights_map`` (a cpu state dict, or an
:class:`~torchbay.big_modeling.offload_index.OffloadedWeightsLoader` reading the disk) while the module
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
from typing import Any

import torch
from torch import nn

from torchbay.big_modeling.device_map import accelerator_class
from torchbay.data.operations import send_to_device

CPU_DEVICE = torch.device("cpu")


def not_traced(method):
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

    @not_traced
    def pre_forward(self, module, *args, **kwargs):
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    @not_traced
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


# --- aligning devices ----------------------------------------------------------------------


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

    @not_traced
    def pre_forward(self, module, *args, **kwargs):
        previous = self.prev_module_hook
        if isinstance(previous, UserCpuOffloadHook):
            first = next(previous.model.parameters(), None)
            if first is not None and first.device != CPU_DEVICE:
                previous.offload()
        first = next(module.parameters(), None)
        if first is not None and first.device == torch.device(self.execution_device):
            return args, kwargs
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def _default_device() -> torch.device:
    """The device a run uses: the running Accelerator's, else the accelerator big-model
    placement uses (device index 0), else the cpu."""
    cls = accelerator_class()
    return torch.device(cls.torch_type(), 0) if cls is not None else CPU_DEVICE


class UserCpuOffloadHook:
    """What :func:`~torchbay.big_modeling.modeling.cpu_offload_with_hook` returns: ``offload()`` sends the
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

    @not_traced
    def pre_forward(self, module, *args, **kwargs):
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    @not_traced
    def post_forward(self, module, output):
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


# --- questions and temporary alignment -------------------------------------------------------


__all__ = ["CpuOffload", "LayerwiseCastingHook", "ModelHook", "SequentialHook", "UserCpuOffloadHook",
           "add_hook_to_module", "remove_hook_from_module", "remove_hook_from_submodules"]
