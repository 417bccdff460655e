"""Smaller big-model helpers of ``accelerate.utils``: ties, sizes, state dicts (offload folders
are in offload_index.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchbay.big_modeling.align_hook import align_module_device, has_offloaded_params
from torchbay.big_modeling.device_map import _units, compute_module_sizes, device_of, get_max_layer_size
from torchbay.storage.safe_load import safe_torch_load

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

    return safe_torch_load(path, "load_state_dict")


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model with offloaded modules, on the cpu, one module brought in at a time."""
    state, meta = {}, set()
    for name, module in model.named_modules():
        if not name:
            continue
        with align_module_device(module, "cpu"):
            for key, value in module.state_dict().items():
                full = f"{name}.{key}"
                if value.is_meta:
                    meta.add(full)
                else:
                    state[full] = value.to("cpu")
    left = sorted(meta - set(state))
    if left:
        log.warning("these tensors were not saved: they are still on the meta device: %s", left)
    return state


def get_state_dict_from_offload(module: nn.Module, module_name: str, state_dict: dict[str, Any],
                                device_to_put_offload: Any = "cpu") -> dict[str, Any]:
    """Fill ``state_dict``'s entries of ``module`` (named ``module_name``, a tensor's full name) with
    its tensors, brought onto ``device_to_put_offload`` when the module is offloaded."""
    root = module_name[: module_name.rfind(".")]
    with align_module_device(module, device_to_put_offload if has_offloaded_params(module) else None):
        for key, value in module.state_dict().items():
            if f"{root}.{key}" in state_dict:
                state_dict[f"{root}.{key}"] = value
    return state_dict


__all__ = ["calculate_maximum_sizes", "check_tied_parameters_on_same_device", "clean_state_dict_for_safetensors",
           "extract_submodules_state_dict", "get_state_dict_from_offload", "get_state_dict_offloaded_model",
           "load_state_dict", "retie_parameters"]
