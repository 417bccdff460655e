"""Offload folders and offload indexes in Accelerate's format, read and written.

An offload index maps a tensor name to where its value waits, in one of Accelerate's two forms:

- ``{"dtype": "float16", "shape": [4, 8]}``: raw bytes in ``<offload folder>/<name>.dat``
  (what ``offload_weight`` writes, and diffusers through it);
- ``{"safetensors_file": path, "weight_name": key, "dtype": "float16"}``: a tensor of a
  safetensors file, often the original checkpoint (what transformers writes for ``"disk"``
  placements, and what torchbay writes for its own copies).

The folder's index is ``index.json``. A ``.dat`` file holds raw numbers (read with a memory
map), never a pickle. torchbay overwrites no file it did not write: the names it wrote into a
folder are listed in ``torchbay_offload_written.txt`` there, and any other existing file of
the same name is refused.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from torchbay.errors import CheckpointError

INDEX = "index.json"
LEDGER = "torchbay_offload_written.txt"
LEGACY_INDEX = "torchbay_offload_index.json"  # torchbay's own format before Accelerate's was adopted

#: model -> {tensor name: source} of the weights load_checkpoint_in_model left on disk (dispatch_model reads it)
OFFLOADED: "weakref.WeakKeyDictionary[nn.Module, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"offload index: {name!r} is not a torch dtype")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- one tensor of a safetensors file --------------------------------------------------------


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

    def load(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self.handle(self.path).get_tensor(self.key)  # a view of the mapped file: no copy yet
        dtype = dtype or self.dtype
        if dtype is not None and tensor.is_floating_point():
            return tensor.to(device=device, dtype=dtype)
        return tensor.to(device=device)

    def entry(self) -> dict[str, Any]:
        """This source as an entry of Accelerate's offload index."""
        entry: dict[str, Any] = {"safetensors_file": self.path, "weight_name": self.key}
        if self.dtype is not None:
            entry["dtype"] = dtype_name(self.dtype)
        return entry


def source_of(entry: Mapping, name: str) -> FileSource | None:
    """The file source of a safetensors entry (``None`` for a ``.dat`` entry)."""
    if entry.get("safetensors_file") is None:
        return None
    return FileSource(entry["safetensors_file"], entry.get("weight_name", name), _dtype(entry.get("dtype")))


# --- the lazy maps hooks read weights from ---------------------------------------------------


class OffloadedWeightsLoader(Mapping):
    """Tensors by name, from ``state_dict`` or read when asked from ``index`` (default: the
    ``index.json`` of ``save_folder``); Accelerate's class of the same name and arguments."""

    def __init__(self, state_dict: dict[str, torch.Tensor] | None = None, save_folder: str | Path | None = None,
                 index: Mapping | None = None, device: Any = None):
        if state_dict is None and save_folder is None and index is None:
            raise CheckpointError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            index = read_offload_index(save_folder)
        self.index = {} if index is None else index
        self.all_keys = list(self.state_dict)
        self.all_keys.extend(k for k in self.index if k not in self.state_dict)
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        entry = self.index[key]
        device = "cpu" if self.device is None else self.device
        source = source_of(entry, key)
        if source is not None:
            return source.load(device)
        if self.save_folder is None:
            raise CheckpointError(f"offload index entry '{key}' is a .dat entry and no save_folder was given "
                                  f"to find {key}.dat in")
        return load_offloaded_weight(Path(self.save_folder) / f"{key}.dat", entry).to(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


class PrefixedDataset(Mapping):
    """``dataset`` seen from a submodule: key ``k`` is ``prefix + k`` of ``dataset``."""

    def __init__(self, dataset: Mapping, prefix: str):
        self.dataset, self.prefix = dataset, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return iter([key for key in self.dataset if key.startswith(self.prefix)])

    def __len__(self) -> int:
        return len(self.dataset)  # as Accelerate's: the size of the whole dataset


# --- writing, without overwriting what torchbay did not write --------------------------------


def _written(folder: Path) -> set[str]:
    try:
        return set((folder / LEDGER).read_text(encoding="utf-8").splitlines())
    except FileNotFoundError:
        return set()


def _claim(folder: Path, names: list[str]) -> None:
    """Refuse before writing ``names`` into ``folder`` if one exists and torchbay did not write it;
    record them as torchbay's (one name a line, appended: offloading n weights costs O(n))."""
    folder.mkdir(parents=True, exist_ok=True)
    new = [n for n in names if not (folder / n).exists()]
    mine = _written(folder) if len(new) < len(names) else set()
    foreign = [n for n in names if n not in new and n not in mine]
    if foreign:
        raise CheckpointError(f"offload folder {folder} already holds {', '.join(foreign[:5])}, which torchbay did not "
                              f"write (another run, or Accelerate): torchbay does not overwrite it. Pass an empty "
                              f"offload_folder, or remove those files yourself")
    if new:
        with open(folder / LEDGER, "a", encoding="utf-8") as ledger:
            ledger.write("".join(f"{n}\n" for n in new))


def _write_json(path: Path, data: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str | Path,
                   index: dict | None = None) -> dict | None:
    """Write ``weight`` as ``<offload_folder>/<weight_name>.dat`` (raw, memory-mappable) and
    add its ``{"dtype", "shape"}`` entry to ``index`` (returned, as Accelerate does)."""
    folder = Path(offload_folder)
    dtype = dtype_name(weight.dtype)
    bits = {"bfloat16": torch.int16}.get(dtype, torch.int8 if dtype.startswith("float8_") else None)
    if bits is not None:  # numpy has neither: stored as their bits, the index keeps the torch dtype
        weight = weight.view(bits)
    array = weight.detach().cpu().numpy()
    if index is not None:
        index[weight_name] = {"dtype": dtype if bits is not None else str(array.dtype), "shape": list(array.shape)}
    _claim(folder, [f"{weight_name}.dat"])
    # the raw C-order bytes a memory map reads back (Accelerate writes them through a memmap and msyncs each
    # file: an offload folder is scratch, and a plain write is several times faster)
    np.ascontiguousarray(array).tofile(folder / f"{weight_name}.dat")
    return index


def load_offloaded_weight(weight_file: str | Path, weight_info: Mapping) -> torch.Tensor:
    """One tensor of a ``.dat`` file, given its index entry ``{"dtype", "shape"}``."""
    shape = tuple(weight_info["shape"]) or (1,)
    stored = weight_info["dtype"]
    raw = "int16" if stored == "bfloat16" else "int8" if stored.startswith("float8_") else stored
    try:
        array = np.memmap(weight_file, dtype=raw, shape=shape, mode="r")
    except (FileNotFoundError, ValueError, TypeError) as exc:
        raise CheckpointError(f"offloaded weight {weight_file} cannot be read as {stored} {list(shape)}: {exc}") \
            from None
    if len(weight_info["shape"]) == 0:
        array = array[0]
    tensor = torch.tensor(array)
    if raw != stored:
        tensor = tensor.view(_dtype(stored))
    return tensor


def save_offload_index(index: Mapping | None, offload_folder: str | Path) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json``; torchbay's own file sources
    become safetensors entries."""
    if not index:
        return
    folder = Path(offload_folder)
    _claim(folder, [INDEX])
    current = json.loads((folder / INDEX).read_text()) if (folder / INDEX).exists() else {}
    current.update({k: (v.entry() if isinstance(v, FileSource) else v) for k, v in index.items()})
    _write_json(folder / INDEX, current)


def read_offload_index(folder: str | Path) -> dict[str, Any]:
    """The entries of an offload folder's ``index.json`` (or of torchbay's former index file)."""
    folder = Path(folder)
    try:
        if not (folder / INDEX).exists() and (folder / LEGACY_INDEX).exists():
            data = json.loads((folder / LEGACY_INDEX).read_text())
            return {k: FileSource(v["file"], v["key"], _dtype(v.get("dtype"))).entry()
                    for k, v in data["weights"].items()}
        data = json.loads((folder / INDEX).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} holds no {INDEX}: it is not an offload folder") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{folder / INDEX} is not an offload index; use another offload folder") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise CheckpointError(f"{folder / INDEX} is not an offload index (name -> entry); use another offload folder")
    return data


def offload_state_dict(save_dir: str | Path, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` into ``save_dir`` (``.dat`` files and ``index.json``)."""
    index: dict[str, Any] = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


def write_offload(folder: Path, tensors: dict[str, torch.Tensor]) -> dict[str, FileSource]:
    """torchbay's own copies: ``tensors`` into a new safetensors file of ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    number = 0
    while (folder / f"torchbay-offload-{number:05d}.safetensors").exists():
        number += 1
    path = folder / f"torchbay-offload-{number:05d}.safetensors"
    _claim(folder, [path.name])
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    return {k: FileSource(path.resolve(), k, v.dtype) for k, v in tensors.items()}


__all__ = ["FileSource", "OffloadedWeightsLoader", "PrefixedDataset", "load_offloaded_weight",
           "offload_state_dict", "offload_weight", "read_offload_index",
           "save_offload_index", "write_offload"]
