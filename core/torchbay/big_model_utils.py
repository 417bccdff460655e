"""Smaller big-model helpers of ``accelerate.utils``: ties, state dicts, offload folders.

The offload folder is torchbay's own: safetensors files and ``torchbay_offload_index.json``
(``{name: {"file", "key", "dtype"}}``), not Accelerate's ``.dat`` files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchbay.checkpoint_loading import read_offload_index, save_offload_index, set_module_tensor_to_device, \
    write_offload
from torchbay.device_map import compute_module_sizes, device_of, get_max_layer_size, _units
from torchbay.dispatch_hooks import FileSource

log = logging.getLogger("torchbay")


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make each group of names one parameter again (the first name's)."""
    for group in tied_params:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, first)


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: dict[str, Any]) -> None:
    """Log the ties whose names ``device_map`` puts on different devices (they still work: the
    dispatch hooks bring the weight from its home device while the other module runs)."""
    for group in tied_params:
        devices = {str(device_of(name, device_map)) for name in group}
        if len(devices) > 1:
            log.info("tied parameters %s are placed on %s: the weight is copied to the other device while it runs",
                     group, sorted(devices))


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """``(total bytes, (bytes of the largest leaf layer, its names))``."""
    sizes = compute_module_sizes(model)
    return sizes[""], get_max_layer_size(_units(model, ""), sizes, [])


def extract_submodules_state_dict(state_dict: dict[str, torch.Tensor], submodule_names: list[str]) -> dict:
    """The entries of ``state_dict`` that belong to the named submodules."""
    return {k: v for k, v in state_dict.items()
            if any(k == name or k.startswith(name + ".") or name == "" for name in submodule_names)}


def clean_state_dict_for_safetensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop the later names of tensors that share memory and make the rest contiguous."""
    seen, out = set(), {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.numel():
            key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
            if key in seen:
                continue
            seen.add(key)
            value = value.contiguous()
        out[name] = value
    return out


def load_state_dict(checkpoint_file: str | Path, device_map: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tensors of one checkpoint file (safetensors memory-mapped; torch files with
    ``weights_only=True``), on the cpu."""
    path = Path(checkpoint_file)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    from torchbay.safe_load import safe_torch_load

    return safe_torch_load(path, "load_state_dict")


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str | Path,
                   index: dict | None = None) -> dict:
    """Write one tensor into ``offload_folder``; its entry is added to ``index`` (returned)."""
    index = {} if index is None else index
    index.update(write_offload(Path(offload_folder), {weight_name: weight}))
    return index


def offload_state_dict(save_dir: str | Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Write a whole state dict into the offload folder ``save_dir``, with its index."""
    save_offload_index(write_offload(Path(save_dir), dict(state_dict)), save_dir)


def load_offloaded_weight(weight_file: str | Path, weight_info: dict[str, Any]) -> torch.Tensor:
    """One tensor of torchbay's offload folder (``weight_info``: its index entry)."""
    return FileSource(weight_file, weight_info["key"]).load(torch.device("cpu"))


def load_offloaded_weights(model: nn.Module, index: dict[str, Any] | None, offload_folder: str | Path) -> None:
    """Put every weight of the offload folder back into ``model``, on the cpu."""
    sources = read_offload_index(offload_folder)
    for name in (index or sources):
        set_module_tensor_to_device(model, name, "cpu", value=sources[name].load(torch.device("cpu")))


__all__ = ["calculate_maximum_sizes", "check_tied_parameters_on_same_device", "clean_state_dict_for_safetensors",
           "extract_submodules_state_dict", "load_offloaded_weight", "load_offloaded_weights", "load_state_dict",
           "offload_state_dict", "offload_weight", "retie_parameters"]
