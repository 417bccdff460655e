"""Big-model inference with Accelerate's names: empty init, device maps, cpu and disk offload.

>>> with torchbay.init_empty_weights():
...     model = MyModel(config)                  # parameters on the meta device: no memory
>>> model = torchbay.load_checkpoint_and_dispatch(model, "ckpt/", device_map="auto")
>>> model.hf_device_map                          # {"embed": 0, "layers.0": 0, ..., "head": "cpu"}

The devices and how much each may hold come from the device plugins (see device_map.py);
dispatch.py puts each tensor on its device and attaches the hooks (hooks.py, align_hook.py) that move
activations between devices and bring offloaded weights in; loading.py reads the checkpoint straight
into the placement. docs/big-model-inference.md.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from torchbay.big_modeling.align_hook import AlignDevicesHook
from torchbay.big_modeling.device_map import (
    CPU,
    DISK,
    accelerator_class,
    check_device_map,
    device_key,
    named_module_tensors,
    torch_device,
)
from torchbay.big_modeling.dispatch import dispatch
from torchbay.big_modeling.hook_placement import attach_align_device_hook, attach_layerwise_casting_hooks
from torchbay.big_modeling.hooks import CpuOffload, UserCpuOffloadHook, add_hook_to_module
from torchbay.big_modeling.infer import get_balanced_memory, infer_auto_device_map
from torchbay.big_modeling.loading import load_checkpoint_in_model
from torchbay.big_modeling.offload_index import OffloadedWeightsLoader, save_offload_index, write_offload
from torchbay.distributed.sequence import (  # noqa: F401 (Accelerate's private name, which its tests import)
    refuse_recurrent_layers as _refuse_recurrent_layers_under_sequence_parallelism,
)
from torchbay.errors import ConfigError

DEVICE_MAP_MODES = ("auto", "balanced", "balanced_low_0", "sequential")


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Create every parameter (and, with ``include_buffers``, every buffer) on ``device``.

    A parameter that is already on ``device`` is kept as it is, and one parameter object given
    to several modules becomes one object on ``device``, so a tie made inside the block
    (``self.head.weight = self.embed.weight``) stays one parameter.
    """
    device = torch.device(device)
    if include_buffers:
        with torch.device(device):
            yield
        return
    original = nn.Module.register_parameter
    moved: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(original) -> (original, its copy on device)

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            if id(param) not in moved:  # one parameter given to two modules stays one parameter
                copy = type(param)(param.to(device), requires_grad=param.requires_grad)
                copy.__dict__.update(param.__dict__)  # what a parameter subclass carries
                moved[id(param)] = (param, copy)
            module._parameters[name] = moved[id(param)][1]

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def init_empty_weights(include_buffers: bool | None = None):
    """Build a model of any size in no memory: its parameters on the meta device."""
    return init_on_device(torch.device("meta"), include_buffers=bool(include_buffers))


# --- dispatch ---------------------------------------------------------------------------


def dispatch_model(model: nn.Module, device_map: dict[str, Any], main_device: Any = None,
                   state_dict: dict[str, torch.Tensor] | None = None, offload_dir: str | Path | None = None,
                   offload_index: dict[str, Any] | None = None, offload_buffers: bool = False,
                   skip_keys: str | list[str] | None = None, preload_module_classes: list[str] | None = None,
                   force_hooks: bool = False) -> nn.Module:
    """Place ``model`` as ``device_map`` says and attach the hooks that make it run there.

    Modules on ``"disk"`` (and on ``"cpu"`` when an accelerator is the main device) are
    offloaded: their weights wait on the cpu or on disk and come to ``main_device`` while the
    module runs. The chosen map is set as ``model.hf_device_map``. The work is
    :func:`torchbay.big_modeling.dispatch.dispatch`; the map is checked here, through this
    module's ``check_device_map`` (which transformers replaces for a while, as it does Accelerate's).
    """
    check_device_map(model, device_map)
    return dispatch(model, device_map, main_device=main_device, state_dict=state_dict, offload_dir=offload_dir,
                    offload_index=offload_index, offload_buffers=offload_buffers, skip_keys=skip_keys,
                    preload_module_classes=preload_module_classes, force_hooks=force_hooks)


# --- the user-level entry points ------------------------------------------------------------


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: str | Path,
                                 device_map: str | dict[str, Any] | None = None,
                                 max_memory: dict[int | str, int | str] | None = None,
                                 no_split_module_classes: list[str] | None = None,
                                 offload_folder: str | Path | None = None, offload_buffers: bool = False,
                                 dtype: Any = None, offload_state_dict: bool | None = None,
                                 skip_keys: str | list[str] | None = None,
                                 preload_module_classes: list[str] | None = None, force_hooks: bool = False,
                                 strict: bool = False, full_state_dict: bool = True,
                                 broadcast_from_rank0: bool = False) -> nn.Module:
    """Load ``checkpoint`` into ``model`` (built under :func:`init_empty_weights`) and dispatch it.

    ``device_map``: ``"auto"`` / ``"balanced"`` (spread evenly over the accelerators),
    ``"balanced_low_0"`` (the first accelerator holds as little as possible), ``"sequential"``
    (fill each device in turn), or an explicit ``{name: device}``; ``None`` loads without
    dispatching. What fits nowhere goes to disk only when ``offload_folder`` is given (else the
    error names the module and the shortfall).
    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_MODES:
            raise ConfigError(f"device_map={device_map!r} is not a mode: use one of {', '.join(DEVICE_MAP_MODES)} or "
                              f"a dict {{module name: device}}", header="cannot place the model")
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory, no_split_module_classes, dtype=dtype,
                                             low_zero=device_map == "balanced_low_0")
        disk_ok = offload_folder is not None or (max_memory is not None and DISK in max_memory)
        device_map = infer_auto_device_map(model, max_memory, no_split_module_classes, dtype=dtype,
                                           offload_buffers=offload_buffers, offload_to_disk=disk_ok)
    load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=offload_folder, dtype=dtype,
                             offload_state_dict=bool(offload_state_dict), offload_buffers=offload_buffers,
                             strict=strict, full_state_dict=full_state_dict,
                             broadcast_from_rank0=broadcast_from_rank0)
    if device_map is None:
        return model
    return dispatch_model(model, device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
                          skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks)


def _default_execution_device(execution_device: Any) -> Any:
    if execution_device is not None:
        return execution_device
    return 0 if accelerator_class() is not None else CPU


def cpu_offload(model: nn.Module, execution_device: Any = None, offload_buffers: bool = False,
                state_dict: dict[str, torch.Tensor] | None = None,
                preload_module_classes: list[str] | None = None) -> nn.Module:
    """Keep the weights on the cpu; each module's come to ``execution_device`` (default: the
    accelerator big-model placement uses, else the cpu) while it runs."""
    execution_device = _execution_device(execution_device)
    if state_dict is None:  # parameter objects kept: a tie is still one tensor once the hooks are removed
        state_dict = {name: tensor.to("cpu") for name, tensor in _persistent_tensors(model)}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=state_dict, preload_module_classes=preload_module_classes)
    return model


def disk_offload(model: nn.Module, offload_dir: str | Path, execution_device: Any = None,
                 offload_buffers: bool = False, preload_module_classes: list[str] | None = None) -> nn.Module:
    """Write the weights into ``offload_dir`` (a new safetensors file and ``index.json``) and
    read each module's while it runs."""
    execution_device = _execution_device(execution_device)
    tensors = dict(_persistent_tensors(model))
    missing = sorted(name for name, t in tensors.items() if t.is_meta)
    if missing:
        raise ConfigError(f"{', '.join(missing[:12])} are on the meta device: disk_offload writes the model's own "
                          f"weights; load them first (or use load_checkpoint_and_dispatch)",
                          header="cannot offload to disk")
    first: dict[int, str] = {}  # a tied tensor is written once, under its first name
    for name, tensor in tensors.items():
        first.setdefault(id(tensor), name)
    written = write_offload(Path(offload_dir), {name: tensors[name] for name in first.values()})
    index = {name: written[first[id(tensor)]].entry() for name, tensor in tensors.items()}
    save_offload_index(index, offload_dir)
    loader = OffloadedWeightsLoader(save_folder=offload_dir, index=index)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
                             weights_map=loader, preload_module_classes=preload_module_classes)
    return model


def _persistent_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer under each of its names (parameter objects kept)."""
    return (list(model.named_parameters(remove_duplicate=False))
            + [(n, b) for n, b in named_module_tensors(model, recurse=True, remove_non_persistent=True)
               if n not in dict(model.named_parameters(remove_duplicate=False))])


def _execution_device(execution_device: Any) -> torch.device:
    return torch_device(device_key(_default_execution_device(execution_device)))


def cpu_offload_with_hook(model: nn.Module, execution_device: Any = None,
                          prev_module_hook: UserCpuOffloadHook | None = None) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move the whole model to ``execution_device`` when it runs and leave it there until
    ``hook.offload()``; chained with ``prev_module_hook``, running this model first offloads that one."""
    hook = CpuOffload(execution_device=_execution_device(execution_device), prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


__all__ = ["UserCpuOffloadHook", "attach_layerwise_casting_hooks", "cpu_offload", "cpu_offload_with_hook",
           "disk_offload", "dispatch_model", "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch"]
