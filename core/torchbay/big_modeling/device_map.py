"""Where each part of a model goes: tensor sizes, memory budgets and device maps.

A device map is ``{module or tensor name: device}``, the device being an accelerator index
(``0``, ``1``... of the device plugin big-model placement uses), ``"cpu"`` or ``"disk"``.
How much fits on each device comes from the device plugins (``DeviceBackend.placement_budget``):
the core names no accelerator; whichever available device plugin has the highest priority
(or the device of the running ``Accelerator``) provides the indexes.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from typing import Any, Iterator

import torch
from torch import nn

from torchbay.errors import ConfigError
from torchbay.process import running
from torchbay.registry.manager import get_plugin_manager

log = logging.getLogger("torchbay")

DISK = "disk"
CPU = "cpu"


def _error(message: str) -> ConfigError:
    return ConfigError(message, header="cannot place the model")


# --- devices ------------------------------------------------------------------------------


def accelerator_class():
    """The device plugin class whose devices big-model placement uses, or ``None`` (cpu only).

    The device of a live ``Accelerator`` when it is not the cpu, else the available
    registered device of highest priority other than the cpu.
    """
    for backend in running.live_device_backends():
        if type(backend).torch_type() != CPU:
            return type(backend)

    found = []
    for cls in get_plugin_manager().registries()["devices"].values():
        try:
            if cls.torch_type() != CPU and cls.is_available():
                found.append(cls)
        except Exception:  # a broken plugin's detection never breaks placement on the others
            continue
    return max(found, key=lambda c: c.priority) if found else None


def _cpu_class():
    return get_plugin_manager().registries()["devices"][CPU]


def device_key(device: Any) -> int | str:
    """A device map value in its canonical form: an accelerator index, ``"cpu"`` or ``"disk"``."""
    if isinstance(device, bool):
        raise _error(f"{device!r} is not a device (use an accelerator index, 'cpu' or 'disk')")
    if isinstance(device, int):
        return device
    if isinstance(device, torch.device):
        return CPU if device.type == CPU else (device.index or 0)
    if isinstance(device, str):
        text = device.strip()
        if text in (CPU, DISK):
            return text
        if text.isdigit():
            return int(text)
        kind, _, index = text.partition(":")
        cls = accelerator_class()
        if cls is not None and kind == cls.torch_type() and (not index or index.isdigit()):
            return int(index or 0)
        have = f"'{cls.torch_type()}' (installed)" if cls is not None else "none here: only 'cpu' and 'disk'"
        raise _error(f"device {device!r} is not known: use an index, 'cpu', 'disk' or '<type>:<index>' of the "
                     f"accelerator big-model placement uses ({have})")
    raise _error(f"{device!r} is not a device (use an accelerator index, 'cpu' or 'disk')")


def torch_device(key: int | str) -> torch.device:
    """The torch device of a device-map value (``"disk"`` has none: weights stay on meta)."""
    key = device_key(key)
    if key == CPU:
        return torch.device(CPU)
    if key == DISK:
        return torch.device("meta")
    cls = accelerator_class()
    if cls is None:
        raise _error(f"device {key} is an accelerator index but no accelerator is available here; place it on "
                     f"'cpu' or 'disk', or install the device plugin of your accelerator")
    return torch.device(cls.torch_type(), key)


def convert_file_size_to_int(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9 (``"5GiB"`` -> 5 * 2**30)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            value = int(float(text[:-len(unit)]) * factor)
            if value < 0:
                raise ValueError(f"{size!r} is a negative size")
            return value
    raise ValueError(f"{size!r} is not a size like '5GB' or '500MiB'")


def parse_size(value: Any, what: str) -> int:
    try:
        size = convert_file_size_to_int(value) if not isinstance(value, float) else int(value)
    except (ValueError, AttributeError):
        raise _error(f"{what}: {value!r} is not a size (bytes as an int, or a string like '300MB' or '2GiB')") \
            from None
    if size < 0:
        raise _error(f"{what}: {value!r} is negative")
    return size


def get_max_memory(max_memory: dict[int | str, int | str] | None = None) -> dict[int | str, int]:
    """Bytes per device, accelerator indexes first, then ``"cpu"`` (then ``"disk"`` if given).

    Without ``max_memory``: each device's ``placement_budget`` (free memory less a headroom for
    activations), asked from the device plugins. As in Accelerate, the sizes written as strings
    in the caller's dict are converted there, in place (transformers relies on it).
    """
    if max_memory is None:
        out: dict[int | str, int] = {}
        cls = accelerator_class()
        if cls is not None:
            out.update(sorted(cls.placement_budget().items()))
        out[CPU] = _cpu_class().placement_budget()[0]
        return out
    parsed = {}
    for key, value in max_memory.items():
        parsed[device_key(key)] = parse_size(value, f"max_memory[{key!r}]")
    for key, value in list(max_memory.items()):
        if isinstance(value, str):
            max_memory[key] = parsed[device_key(key)]
    indexes = sorted(k for k in parsed if isinstance(k, int))
    return {**{i: parsed[i] for i in indexes}, **{k: parsed[k] for k in (CPU, DISK) if k in parsed}}


# --- tensors and sizes ----------------------------------------------------------------------


def named_module_tensors(module: nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the parameters (and buffers) of ``module``."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        for name, buf in module.named_buffers(recurse=recurse):
            owner, _, leaf = name.rpartition(".")
            if remove_non_persistent and leaf in module.get_submodule(owner)._non_persistent_buffers_set:
                continue
            yield name, buf


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, storage pointer, storage size): equal for tensors that share memory."""
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def find_tied_parameters(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that are one parameter object (ties), each group sorted."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def parse_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise _error(f"dtype {dtype!r} is not a torch dtype (e.g. torch.float16 or 'bfloat16')")
    return value


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    if dtype is not None and tensor.is_floating_point():
        return tensor.numel() * dtype.itemsize
    return tensor.numel() * tensor.element_size()


def compute_module_sizes(model: nn.Module, dtype: Any = None, special_dtypes: dict[str, Any] | None = None,
                         buffers_only: bool = False) -> dict[str, int]:
    """Bytes of every module and tensor by name (``""``: the model); a tied tensor counts once,
    under its first name. ``dtype`` applies to floating-point tensors."""
    dtype = parse_dtype(dtype)
    special = {k: parse_dtype(v) for k, v in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)
    tensors = [] if buffers_only else list(model.named_parameters())
    tensors += list(model.named_buffers())
    for name, tensor in tensors:
        size = tensor.numel() * special[name].itemsize if name in special else tensor_bytes(tensor, dtype)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += size
    return sizes


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list:
    """Every module, children before their parents (the model last)."""
    out = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append(name if return_fqns else module)

    visit("", model)
    return out


def _splittable(module: nn.Module, no_split: set[str]) -> bool:
    return type(module).__name__ not in no_split and next(module.children(), None) is not None


def get_max_layer_size(modules: list[tuple[str, nn.Module]], module_sizes: dict[str, int],
                       no_split_module_classes: list[str]) -> tuple[int, list[str]]:
    """The largest unsplittable piece among ``modules`` (searched into their children) and its names."""
    no_split = set(no_split_module_classes or [])
    best, names = 0, []
    queue = list(modules)
    while queue:
        name, module = queue.pop(0)
        if isinstance(module, nn.Module) and _splittable(module, no_split):
            queue = [(f"{name}.{n}" if name else n, c) for n, c in module.named_children()] + queue
            continue
        size = module_sizes.get(name, 0)
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


def _units(module: nn.Module, prefix: str) -> list[tuple[str, Any]]:
    """What placing ``module`` piece by piece means: its own tensors, then its children."""
    join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    own = [(join(n), t) for n, t in named_module_tensors(module, recurse=False)]
    return own + [(join(n), c) for n, c in module.named_children()]


def check_device_map(model: nn.Module, device_map: dict[str, Any]) -> None:
    """Every parameter and buffer of ``model`` is covered by an entry of ``device_map`` (a key that names
    no submodule or tensor is warned about, as Accelerate does)."""
    known = {name for name, _ in model.named_modules()} | set(all_tensor_names(model))
    unknown = [key for key in device_map if key not in known]
    if unknown:
        warnings.warn(f"device_map keys do not match any submodules or tensors of the model: "
                      f"{', '.join(map(repr, unknown))}; they place nothing (check their spelling)", stacklevel=2)
    if "" in device_map:
        return
    uncovered = []
    for name in all_tensor_names(model):
        try:
            device_of(name, device_map)
        except KeyError:
            uncovered.append(name)
    if uncovered:
        raise _error(f"device_map places no device for {', '.join(uncovered[:10])}"
                     f"{f' (and {len(uncovered) - 10} more)' if len(uncovered) > 10 else ''}: add entries for "
                     f"them (or for a module that contains them)")


def all_tensor_names(model: nn.Module) -> list[str]:
    """Every parameter and buffer name, a tied tensor under each of its names."""
    return ([n for n, _ in model.named_parameters(remove_duplicate=False)]
            + [n for n, _ in model.named_buffers(remove_duplicate=False)])


def device_of(name: str, device_map: dict[str, Any]) -> Any:
    """The device ``device_map`` gives tensor or module ``name`` (its longest matching entry)."""
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        key = ".".join(parts[:i])
        if key in device_map:
            return device_map[key]
    raise KeyError(name)


def clean_device_map(device_map: dict[str, Any], module_name: str = "") -> dict[str, Any]:
    """Accelerate's clean-up, in place: the entries under ``module_name`` that all name one device
    become one entry for the module (recursively, children after their parent)."""
    prefix = f"{module_name}." if module_name else ""
    under = [k for k in device_map if k.startswith(prefix)]
    values = [device_map[k] for k in under]
    if len(values) > 1 and len({(type(v).__name__, str(v)) for v in values}) == 1:
        for key in under:
            del device_map[key]
        device_map[module_name] = values[0]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = {".".join(k.split(".")[:depth]) for k in device_map
                if k.startswith(prefix) and len(k) > len(module_name)}
    for child in children:
        clean_device_map(device_map, module_name=child)
    return device_map


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers of ``module`` that its state dict leaves out."""
    found = set(module._non_persistent_buffers_set)
    if recurse:
        for name, sub in module.named_modules():
            if name:
                found |= {f"{name}.{b}" if fqns else b for b in sub._non_persistent_buffers_set}
    return found


def get_module_leaves(module_sizes: dict[str, int]) -> list[str]:
    """The names of ``module_sizes`` that no other name is a child of (the model excluded)."""
    children: dict[str, int] = defaultdict(int)
    for name in module_sizes:
        if name and "." in name:
            children[name.rsplit(".", 1)[0]] += 1
    return [name for name in module_sizes if name and children.get(name, 0) == 0]


def compute_module_total_buffer_size(model: nn.Module, dtype: Any = None,
                                     special_dtypes: dict[str, Any] | None = None) -> int:
    """Bytes of all the buffers of ``model``."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)


def get_module_size_with_ties(tied_params: list[str], module_size: int, module_sizes: dict[str, int],
                              modules_to_treat: list[tuple[str, nn.Module]]) -> tuple[int, list[str], list]:
    """The size of a module with the modules its ``tied_params`` live in (those counted once),
    their names and the modules: what placing it next to its tied partners costs."""
    if not tied_params:
        return module_size, [], []
    names, modules = [], []
    for param in tied_params:
        name, module = next((n, m) for n, m in modules_to_treat if param.startswith(n + "."))
        names.append(name)
        modules.append(module)
    size = module_size + sum(module_sizes[name] - module_sizes[param] for param, name in zip(tied_params, names))
    return size, names, modules


def check_device_same(first_device: Any, second_device: Any) -> bool:
    """Whether two devices are the same, an accelerator without index meaning index 0."""
    first, second = torch.device(first_device), torch.device(second_device)
    if first.type != second.type:
        return False
    return (first.index or 0) == (second.index or 0)
