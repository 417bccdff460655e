"""Big-model inference with Accelerate's names: empty init, device maps, cpu and disk offload.

>>> with torchbay.init_empty_weights():
...     model = MyModel(config)                  # parameters on the meta device: no memory
>>> model = torchbay.load_checkpoint_and_dispatch(model, "ckpt/", device_map="auto")
>>> model.hf_device_map                          # {"embed": 0, "layers.0": 0, ..., "head": "cpu"}

The devices and how much each may hold come from the device plugins (see device_map.py);
dispatch_hooks.py moves activations between devices and brings offloaded weights in;
checkpoint_loading.py reads the checkpoint straight into the placement. docs/big-model-inference.md.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from torchbay.checkpoint_loading import (OFFLOADED, Slot, load_checkpoint_in_model, model_slots, read_offload_index,
                                         write_offload, save_offload_index)
from torchbay.device_map import (CPU, DISK, accelerator_class, check_device_map, device_key,
                                 get_balanced_memory, infer_auto_device_map, torch_device)
from torchbay.dispatch_hooks import Borrowed, DispatchHook, FileSource, TensorSource, remove_hook_from_module
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


def _main_device(device_map: dict[str, Any], main_device: Any) -> Any:
    if main_device is not None:
        return device_key(main_device)
    return next((d for d in device_map.values() if d not in (CPU, DISK)), CPU)


def _resolve(slot: Slot, where: Any, state_dict: dict | None) -> torch.Tensor:
    """The value of a slot: from ``state_dict`` (any of its names), else the model's own tensor."""
    for name in slot.names:
        if state_dict is not None and name in state_dict:
            return state_dict[name]
    if slot.tensor.device.type == "meta":
        raise ConfigError(f"'{' = '.join(slot.names)}' is on the meta device and nothing gives its value: load a "
                          f"checkpoint (load_checkpoint_and_dispatch) or pass state_dict=",
                          header="cannot dispatch the model")
    return slot.tensor


def _check_values(slots: list[Slot], state_dict: dict | None) -> None:
    missing = [" = ".join(s.names) for s in slots if s.tensor.device.type == "meta"
               and not (state_dict is not None and any(n in state_dict for n in s.names))]
    if missing:
        raise ConfigError(f"{len(missing)} tensor(s) are on the meta device and nothing gives their value: "
                          f"{', '.join(missing[:12])}; load a checkpoint (load_checkpoint_and_dispatch) or pass "
                          f"state_dict=", header="cannot dispatch the model")


def dispatch_model(model: nn.Module, device_map: dict[str, Any], main_device: Any = None,
                   state_dict: dict[str, torch.Tensor] | None = None, offload_dir: str | Path | None = None,
                   offload_index: dict[str, Any] | None = None, offload_buffers: bool = False,
                   skip_keys: str | list[str] | None = None, preload_module_classes: list[str] | None = None,
                   force_hooks: bool = False) -> nn.Module:
    """Place ``model`` as ``device_map`` says and attach the hooks that make it run there.

    Modules on ``"disk"`` (and on ``"cpu"`` when an accelerator is the main device) are
    offloaded: their weights wait on the cpu or on disk and come to ``main_device`` while the
    module runs. The chosen map is set as ``model.hf_device_map``.
    """
    check_device_map(model, device_map)
    keys = {name: device_key(d) for name, d in device_map.items()}
    main = _main_device(keys, main_device)
    offloaded = {DISK} if main == CPU else {CPU, DISK}
    remove_hook_from_module(model, recurse=True)
    slots, transient = model_slots(model)
    if len(set(keys.values())) == 1 and next(iter(keys.values())) != DISK and not force_hooks:
        device = torch_device(next(iter(keys.values())))
        _check_values(slots + transient, state_dict)
        for slot in slots + transient:
            value = _resolve(slot, device, state_dict)
            if value is not slot.tensor or value.device != device:
                slot.assign(model, value.to(device))
        model.hf_device_map = dict(device_map)
        return model
    disk_sources = _disk_sources(model, offload_dir, offload_index)
    plan, unresolved, no_folder = [], [], []
    transient_ids = {id(s) for s in transient}
    for slot in slots + transient:  # everything is checked before the model changes
        places = [keys[_unit_of(n, keys)] for n in slot.names]
        place = next((p for p in places if p not in offloaded), places[0])
        off = place in offloaded and (slot.is_param or offload_buffers) and id(slot) not in transient_ids
        stored = off and place == DISK and any(n in disk_sources for n in slot.names)
        if not stored and slot.tensor.device.type == "meta" and not (
                state_dict is not None and any(n in state_dict for n in slot.names)):
            unresolved.append(" = ".join(slot.names))
        elif off and place == DISK and not stored and offload_dir is None:
            no_folder.append(slot.names[0])
        plan.append((slot, place, off))
    if unresolved:
        raise ConfigError(f"{len(unresolved)} tensor(s) are on the meta device and nothing gives their value: "
                          f"{', '.join(unresolved[:12])}; load a checkpoint (load_checkpoint_and_dispatch) or pass "
                          f"state_dict=", header="cannot dispatch the model")
    if no_folder:
        raise ConfigError(f"device_map puts {', '.join(no_folder[:12])} on 'disk' and no offload folder holds them: "
                          f"pass offload_dir= (a folder for their copies)", header="cannot offload to disk")
    home: dict[int, Any] = {}  # slot id -> torch device, or a source for offloaded slots
    pending: dict[str, torch.Tensor] = {}
    for slot, place, off in plan:
        if off:
            home[id(slot)] = _offload(slot, place, state_dict, disk_sources, pending)
        else:
            device = torch_device(main if place in offloaded else place)
            value = _resolve(slot, device, state_dict)
            if value is not slot.tensor or value.device != device:
                slot.assign(model, value.to(device))
            home[id(slot)] = device
    _write_pending(pending, offload_dir, slots, home)
    for slot in slots:
        if not isinstance(home[id(slot)], torch.device) and slot.tensor.device.type != "meta":
            slot.assign(model, torch.empty(slot.tensor.shape, dtype=slot.tensor.dtype, device="meta"))
    _attach_hooks(model, keys, main, offloaded, slots + transient, home, skip_keys, preload_module_classes or [])
    model.hf_device_map = dict(device_map)
    return model


def _unit_of(name: str, keys: dict[str, Any]) -> str:
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        if ".".join(parts[:i]) in keys:
            return ".".join(parts[:i])
    raise KeyError(name)


def _disk_sources(model: nn.Module, offload_dir, offload_index) -> dict[str, Any]:
    sources = dict(OFFLOADED.get(model, {}))
    if offload_index:
        for name, entry in offload_index.items():
            if isinstance(entry, (FileSource, TensorSource)):
                sources[name] = entry
            elif isinstance(entry, dict) and "file" in entry and "key" in entry:
                sources[name] = FileSource(entry["file"], entry["key"])
            else:
                raise ConfigError(f"offload_index['{name}'] is {entry!r}: torchbay reads its own offload index "
                                  f"({{'file': ..., 'key': ...}}), not Accelerate's .dat files; offload with "
                                  f"torchbay (disk_offload or load_checkpoint_and_dispatch(offload_folder=...))",
                                  header="cannot dispatch the model")
    elif offload_dir is not None and (Path(offload_dir) / "torchbay_offload_index.json").exists() and not sources:
        sources = read_offload_index(offload_dir)
    return sources


def _offload(slot: Slot, place: Any, state_dict, disk_sources, pending: dict) -> Any:
    """Where an offloaded slot waits: a cpu tensor, or a safetensors file on disk (``None``: the
    tensor is added to ``pending``, to be written into the offload folder)."""
    source = next((disk_sources[n] for n in slot.names if n in disk_sources), None) if place == DISK else None
    if source is not None:
        return source
    value = _resolve(slot, place, state_dict)
    if place == CPU:
        return TensorSource(value.to("cpu"))
    pending[slot.names[0]] = value
    return None


def _write_pending(pending: dict, offload_dir, slots: list[Slot], home: dict) -> None:
    if not pending:
        return
    if offload_dir is None:
        raise ConfigError(f"device_map puts {', '.join(list(pending)[:5])} on 'disk' and no offload folder holds them: "
                          f"pass offload_dir= (a folder for their copies)", header="cannot offload to disk")
    written = write_offload(Path(offload_dir), pending)
    index = {}
    for slot in slots:
        if slot.names[0] in written:
            home[id(slot)] = written[slot.names[0]]
            index.update({n: written[slot.names[0]] for n in slot.names})
    save_offload_index(index, offload_dir)


def _attach_hooks(model, keys, main, offloaded, slots, home, skip_keys, preload) -> None:
    """One hook per module that needs one (see dispatch_hooks.py)."""
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
    for unit, place in keys.items():
        device = execution(place)
        module = _get(model, unit)
        if isinstance(module, nn.Module):
            exec_device.setdefault(unit, device)
            for rel, _ in module.named_modules():
                full = f"{unit}.{rel}" if unit and rel else unit or rel
                if rel and away(full, device):
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
        if type(module).__name__ in preload:
            items = [(f"{name}.{n}".strip(".").rpartition(".")[0], n.rpartition(".")[2]) for n, _ in _tensors(module)]
        else:
            items = [(name, leaf) for leaf, _ in owner_slots.get(name, [])]
        borrowed = []
        for owner, leaf in items:
            slot = by_name[f"{owner}.{leaf}" if owner else leaf]
            where = home[id(slot)]
            if isinstance(where, torch.device):
                if where != device:
                    borrowed.append(Borrowed(model.get_submodule(owner), leaf, TensorSource(slot.tensor)))
            else:
                borrowed.append(Borrowed(model.get_submodule(owner), leaf, where))
        DispatchHook(device, borrowed, io_same_device=(name == ""), skip_keys=skip_keys).attach(module)
    if "" not in exec_device:
        DispatchHook(torch_device(main), [], io_same_device=True, skip_keys=skip_keys).attach(model)


def _tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _get(model: nn.Module, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


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
    """Keep the weights on the cpu; each module's come to ``execution_device`` while it runs."""
    return dispatch_model(model, {"": CPU}, main_device=_default_execution_device(execution_device),
                          state_dict=state_dict, offload_buffers=offload_buffers,
                          preload_module_classes=preload_module_classes, force_hooks=True)


def disk_offload(model: nn.Module, offload_dir: str | Path, execution_device: Any = None,
                 offload_buffers: bool = False, preload_module_classes: list[str] | None = None) -> nn.Module:
    """Write the weights to ``offload_dir`` (safetensors) and read each module's while it runs."""
    return dispatch_model(model, {"": DISK}, main_device=_default_execution_device(execution_device),
                          offload_dir=offload_dir, offload_buffers=offload_buffers,
                          preload_module_classes=preload_module_classes, force_hooks=True)


class UserCpuOffloadHook:
    """Returned by :func:`cpu_offload_with_hook`: ``offload()`` sends the model back to the cpu,
    ``remove()`` takes the hook off."""

    def __init__(self, model: nn.Module, execution_device: torch.device, prev: UserCpuOffloadHook | None):
        self.model, self.execution_device, self.prev = model, execution_device, prev
        self.handle = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        from torchbay.operations import send_to_device

        if self.prev is not None:
            self.prev.offload()
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    def offload(self) -> None:
        self.model.to("cpu")

    def remove(self) -> None:
        self.handle.remove()


def cpu_offload_with_hook(model: nn.Module, execution_device: Any = None,
                          prev_module_hook: UserCpuOffloadHook | None = None) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move the whole model to ``execution_device`` when it runs and leave it there until
    ``hook.offload()``; chained with ``prev_module_hook``, running this model first offloads that one."""
    device = torch_device(device_key(_default_execution_device(execution_device)))
    return model, UserCpuOffloadHook(model, device, prev_module_hook)


__all__ = ["UserCpuOffloadHook", "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model",
           "init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch"]
