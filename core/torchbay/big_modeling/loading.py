"""Loading a checkpoint into a model, straight into each tensor's final place.

One shard at a time, each tensor is read from the memory-mapped file and put where the device
map says: on the cpu it stays a view of the mapped file (no copy; a ``dtype`` makes one
converted copy), on an accelerator it is copied there from the mapping, and on ``"disk"`` it
is not read at all (the hooks read it from the checkpoint when its module runs; a torch
``.bin`` source is copied into ``offload_folder`` as safetensors). Every parameter object is
replaced once for all of its names, so ties (also those made under ``init_empty_weights``)
survive. The checkpoint is checked against the model before anything changes.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from torchbay.big_modeling.device_map import DISK, check_device_map, device_key, device_of, parse_dtype, torch_device
from torchbay.big_modeling.files import CheckpointFiles, resolve_checkpoint
from torchbay.big_modeling.offload_index import (
    OFFLOADED,
    FileSource,
    OffloadedWeightsLoader,
    save_offload_index,
    write_offload,
)
from torchbay.big_modeling.slots import Slot, few, model_slots
from torchbay.errors import CheckpointError, ConfigError, TorchbayError
from torchbay.tracking.progress import progress_bar

log = logging.getLogger("torchbay")


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint's keys or shapes do not fit the model (a ValueError, as Accelerate's strict loading raises)."""


class TensorShapeError(TorchbayError, ValueError):
    """A value of another shape than the model's tensor was given (its message is Accelerate's, word for word)."""

def check_against(model_slots_: list[Slot], transient: list[Slot], files: CheckpointFiles, strict: bool) -> dict:
    """``{slot index: checkpoint key}``; raises (or warns) for what does not match, before any change."""
    keys = files.keys()
    found, missing_meta, missing_real = {}, [], []
    for i, slot in enumerate(model_slots_):
        key = next((n for n in slot.names if n in keys), None)
        if key is None:
            (missing_meta if slot.tensor.device.type == "meta" else missing_real).append(" = ".join(slot.names))
        else:
            found[i] = files.aliases.get(key, key)
    known = {n for slot in model_slots_ for n in slot.names}
    unexpected = sorted(k for k in keys if k not in known)
    problems = []
    if missing_meta:
        problems.append(f"it lacks {len(missing_meta)} weight(s) the model holds no value for (they are on the meta "
                        f"device): {few(missing_meta)}")
    if strict and missing_real:
        problems.append(f"it lacks {len(missing_real)} weight(s) of the model (strict=True): {few(missing_real)}")
    if strict and unexpected:
        problems.append(f"it has {len(unexpected)} key(s) the model does not have (strict=True): {few(unexpected)}")
    meta_transient = [s.names[0] for s in transient if s.tensor.device.type == "meta"]
    if meta_transient:
        problems.append(f"non-persistent buffers {few(meta_transient)} are on the meta device and no checkpoint "
                        f"holds them: build the model with init_empty_weights(include_buffers=False)")
    if files.is_safetensors:
        headers = files.headers()
        for i, key in found.items():
            shape = headers.get(key, (None,))[0]
            if shape is not None and tuple(shape) != tuple(model_slots_[i].tensor.shape):
                problems.append(f"'{key}' has shape {list(shape)} in the checkpoint but "
                                f"{list(model_slots_[i].tensor.shape)} in the model")
    if problems:
        fix = "; or pass strict=False to only warn about weights the model already holds and extra keys" \
            if strict else ""
        raise CheckpointMismatchError(f"checkpoint {files.where} does not match the model (nothing was loaded):\n  - "
                              + "\n  - ".join(problems) + ("\nfix the checkpoint or the model" + fix
                                                           if missing_real or unexpected else ""))
    if missing_real:
        warnings.warn(f"checkpoint {files.where} lacks {len(missing_real)} weight(s); they keep the values the model "
                      f"had: {few(missing_real)}", stacklevel=3)
    if unexpected:  # logged as Accelerate (and transformers) log it, which tools look for
        log.warning("Some weights of the model checkpoint at %s were not used when initializing the model: %s (it "
                    "does not have them; they were ignored)", files.where, few(unexpected))
    return found


def _target_dtype(slot: Slot, dtype: torch.dtype | None, keep_fp32: list[str]) -> torch.dtype:
    if not slot.tensor.is_floating_point():
        return slot.tensor.dtype
    if keep_fp32 and any(n == m or n.startswith(m + ".") or f".{m}." in f".{n}" for n in slot.names for m in keep_fp32):
        return torch.float32
    return dtype or slot.tensor.dtype


def load_checkpoint_in_model(model: nn.Module, checkpoint: str | Path, device_map: dict[str, Any] | None = None,
                             offload_folder: str | Path | None = None, dtype: Any = None,
                             offload_state_dict: bool = False, offload_buffers: bool = False,
                             keep_in_fp32_modules: list[str] | None = None, offload_8bit_bnb: bool = False,
                             strict: bool = False, full_state_dict: bool = True,
                             broadcast_from_rank0: bool = False) -> None:
    """Load ``checkpoint`` into ``model``, each tensor where ``device_map`` puts it.

    Without a device map, every tensor stays on its device (a meta tensor lands on the cpu).
    ``offload_state_dict`` is accepted for Accelerate's signature: no full state dict is ever
    built here. See the module doc for the rest.
    """
    _refuse_unsupported(offload_8bit_bnb=offload_8bit_bnb, full_state_dict=full_state_dict,
                        broadcast_from_rank0=broadcast_from_rank0)
    dtype = parse_dtype(dtype)
    if device_map is not None:
        check_device_map(model, device_map)
    files = resolve_checkpoint(checkpoint)
    slots, transient = model_slots(model)
    found = check_against(slots, transient, files, strict)
    targets = [_target(slot, device_map) for slot in slots]
    disk = [i for i in found if targets[i] == DISK]
    if disk and not files.is_safetensors and offload_folder is None:
        raise ConfigError(f"device_map puts {few([slots[i].names[0] for i in disk])} on 'disk' and {files.where} "
                          f"is not safetensors: pass offload_folder= (a folder for their copies)",
                          header="cannot offload to disk")
    by_key: dict[str, list[int]] = {}
    for i, key in found.items():
        by_key.setdefault(key, []).append(i)
    sources: dict[str, Any] = {}
    done = 0
    progress = ShardProgress(len(files.files))
    try:
        for file in files.files:
            to_write: dict[str, torch.Tensor] = {}
            for key, get in files.tensors(file):
                for i in by_key.get(key, ()):
                    slot, target = slots[i], targets[i]
                    want = _target_dtype(slot, dtype, keep_in_fp32_modules or [])
                    if target == DISK and (slot.is_param or offload_buffers):
                        if files.is_safetensors:
                            source = FileSource(file, key, want)
                        else:
                            to_write[key] = get().to(want)
                            source = key
                        placeholder = torch.empty(slot.tensor.shape, dtype=want, device="meta")
                        slot.assign(model, placeholder)
                        sources.update({n: source for n in slot.names})
                    else:
                        device = torch.device("cpu") if target == DISK else target
                        slot.assign(model, _convert(get(), device, want))
                    done += 1
            if to_write:
                written = write_offload(Path(offload_folder), to_write)
                sources = {n: written[s] if isinstance(s, str) else s for n, s in sources.items()}
            progress.update()
    except Exception as exc:
        raise CheckpointError(f"loading {files.where} failed ({type(exc).__name__}: {exc}); the model is partially "
                              f"loaded ({done} of {len(found)} tensors replaced): build it again before retrying") \
            from exc
    finally:
        progress.close()
    for slot in transient:
        target = _target(slot, device_map)
        if target != DISK and slot.tensor.device != target:
            slot.assign(model, slot.tensor.to(target))
    if sources:
        OFFLOADED[model] = {**OFFLOADED.get(model, {}), **sources}
        if offload_folder is not None:
            save_offload_index(sources, Path(offload_folder))


class ShardProgress:
    """The "Loading checkpoint shards" bar of a checkpoint of several files, shown once loading has
    taken ``BAR_DELAY_S``. The bar is only made then: a load that ends sooner (the usual case,
    a checkpoint in the page cache) pays for no tqdm bar, whose first one starts tqdm's monitor thread."""

    BAR_DELAY_S = 2.0

    def __init__(self, shards: int):
        self.shards, self.done, self.bar = shards, 0, None
        self.start = time.time()  # tqdm's clock

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.shards >= 2 and time.time() - self.start >= self.BAR_DELAY_S:
            self.bar = progress_bar(total=self.shards, desc="Loading checkpoint shards", unit="shard",
                                    delay=self.BAR_DELAY_S)
            self.bar.start_t = self.bar.last_print_t = self.start  # as if it had been there from the start
            self.bar.update(self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _convert(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One step from the mapped file to the final tensor: no intermediate copy, no fp32 detour."""
    if not tensor.is_floating_point():
        dtype = tensor.dtype
    return tensor.to(device=device, dtype=dtype)


def _target(slot: Slot, device_map: dict[str, Any] | None):
    """The torch device (or ``"disk"``) of a slot: its home is the first of its names not on disk."""
    if device_map is None:
        return torch.device("cpu") if slot.tensor.device.type == "meta" else slot.tensor.device
    keys = [device_key(device_of(n, device_map)) for n in slot.names]
    home = next((k for k in keys if k != DISK), DISK)
    return DISK if home == DISK else torch_device(home)


def _refuse_unsupported(**flags: Any) -> None:
    defaults = {"offload_8bit_bnb": False, "full_state_dict": True, "broadcast_from_rank0": False}
    wrong = [f"{k}={v!r}" for k, v in flags.items() if v != defaults[k]]
    if wrong:
        raise ConfigError(f"{', '.join(wrong)} is not supported: torchbay loads a full state dict into each process "
                          f"itself, without quantization; leave these at their defaults", header="cannot load")


def set_module_tensor_to_device(module: nn.Module, tensor_name: str, device: Any, value: torch.Tensor | None = None,
                                dtype: Any = None, fp16_statistics: Any = None, tied_params_map: Any = None,
                                non_blocking: bool = False, clear_cache: bool = True) -> None:
    """Put tensor ``tensor_name`` of ``module`` on ``device`` (with ``value`` as its data, when given).

    A floating-point value takes ``dtype``, else the dtype the tensor had. Only this name is
    changed: a tie with another name is not followed (see ``load_checkpoint_in_model``).
    """
    owner_name, _, leaf = tensor_name.rpartition(".")
    owner = module.get_submodule(owner_name)
    is_param = leaf in owner._parameters
    if not is_param and leaf not in owner._buffers:
        raise ConfigError(f"{type(owner).__name__} '{owner_name}' has no parameter or buffer '{leaf}'",
                          header="cannot set the tensor")
    old = owner._parameters[leaf] if is_param else owner._buffers[leaf]
    if value is None:
        if old.device.type == "meta" and str(device) != "meta":
            raise ConfigError(f"'{tensor_name}' is on the meta device: give value= to put it on {device}",
                              header="cannot set the tensor")
        value = old
    elif tuple(value.shape) != tuple(old.shape):
        raise TensorShapeError(f'Trying to set a tensor of shape {value.shape} in "{leaf}" (which has shape '
                               f'{old.shape}), this looks incorrect.')
    dtype = parse_dtype(dtype) or (old.dtype if value.is_floating_point() and old is not None else None)
    target = torch.device("meta") if str(device) == "meta" else torch_device(device) if not isinstance(
        device, torch.device) else device
    new = value.to(device=target, dtype=dtype if value.is_floating_point() else None, non_blocking=non_blocking)
    if is_param:
        owner._parameters[leaf] = nn.Parameter(new, requires_grad=old.requires_grad and new.is_floating_point())
    else:
        owner._buffers[leaf] = new


__all__ = ["OFFLOADED", "load_checkpoint_in_model", "load_offloaded_weights", "set_module_tensor_to_device"]


def load_offloaded_weights(model: torch.nn.Module, index: Mapping | None, offload_folder: str | Path) -> None:
    """Put every weight of ``index`` (entries of ``offload_folder``) back into ``model``, on the cpu."""
    if not index:
        return
    loader = OffloadedWeightsLoader(save_folder=offload_folder, index=index)
    for name in index:
        if "SCB" in name:  # 8-bit statistics travel with their weight in Accelerate; torchbay has no 8-bit path
            continue
        set_module_tensor_to_device(model, name, "cpu", value=loader[name])
