"""What a checkpoint path holds, for big-model loading: its files, its keys, read lazily.

Accepted: a ``.safetensors`` file; a Hugging Face index (``*.safetensors.index.json`` or
``pytorch_model.bin.index.json``), given as the file or as its folder; a folder with one
safetensors file; a torchbay ``save_model`` folder (Accelerate's layout, tied-weight aliases in
torchbay's metadata entry) or ``save_state`` folder (its manifest says which files hold the model); a
torch ``.bin`` / ``.pt`` file, read with ``weights_only=True`` only.
Safetensors files are memory-mapped and only their headers are read until a tensor is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch

from torchbay.checkpoint.model_folder import INDEX, MARK, WEIGHTS, check_one_save, newer_of, read_mark
from torchbay.errors import CheckpointError
from torchbay.storage.publish import read_manifest
from torchbay.storage.safe_load import safe_torch_load

MANIFEST = "torchbay_manifest.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")


class CheckpointFiles:
    """The files of one checkpoint and where each key is (``key -> file``)."""

    def __init__(self, where: str, key_file: dict[str, Path], aliases: dict[str, str] | None = None):
        self.where = where
        self.key_file = key_file
        self.aliases = dict(aliases or {})  # name -> the key that holds its tensor (torchbay's deduplicated ties)
        self.files = sorted(set(key_file.values()), key=lambda p: p.name)
        self._torch_cache: dict[Path, dict[str, torch.Tensor]] = {}

    @property
    def is_safetensors(self) -> bool:
        return all(f.suffix == ".safetensors" for f in self.files)

    def keys(self) -> set[str]:
        return set(self.key_file) | set(self.aliases)

    def headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype name)}`` from the safetensors headers (no tensor is read)."""
        from safetensors import safe_open

        out = {}
        for file in self.files:
            if file.suffix != ".safetensors":
                continue
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        out[key] = (tuple(piece.get_shape()), piece.get_dtype())
            except Exception as exc:
                raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None
        return out

    def tensors(self, file: Path) -> Iterator[tuple[str, Any]]:
        """``(key, getter)`` for the keys of ``file``: the getter returns the cpu tensor (for
        safetensors a view of the mapped file; for torch files the loaded tensor)."""
        keys = [k for k, f in self.key_file.items() if f == file]
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in keys:
                    yield key, (lambda k=key: handle.get_tensor(k))
            return
        state = self._torch(file)
        for key in keys:
            yield key, (lambda k=key: state[k])
        self._torch_cache.pop(file, None)

    def _torch(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._torch_cache:

            state = safe_torch_load(file, "load_checkpoint_and_dispatch")
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CheckpointError(f"{file} does not hold a state dict of tensors (name -> tensor); give the "
                                      f"model's weights, e.g. saved with torch.save(model.state_dict(), path)")
            self._torch_cache[file] = state
        return self._torch_cache[file]


def _from_index(index: Path) -> CheckpointFiles:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"the index {index} is not valid JSON ({exc}); it should be a Hugging Face index "
                              f'{{"metadata": {{...}}, "weight_map": {{"<tensor name>": "<file>", ...}}}}') from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if weight_map is None and isinstance(data, dict) and data and all(isinstance(v, str) for v in data.values()):
        weight_map = data  # a bare {name: file} map, as Accelerate also reads
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"the index {index} has no \"weight_map\" object mapping tensor names to files; a "
                              f'Hugging Face index is {{"metadata": {{...}}, "weight_map": {{"<name>": "<file>"}}}}')
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or not v or "/" in v or "\\" in v or v in
           ("..", ".")]
    if bad:
        raise CheckpointError(f"the index {index} maps {', '.join(map(repr, bad[:5]))} to no plain file name of its "
                              f"folder; every weight_map value must be the name of a file next to the index")
    files = {name: index.parent / name for name in set(weight_map.values())}
    missing = sorted(name for name, path in files.items() if not path.is_file())
    if missing:
        raise CheckpointError(f"the index {index} names files that are not in {index.parent}: {', '.join(missing)}; "
                              f"copy the missing shards next to the index")

    check_one_save(index, list(files.values()))
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    own = metadata.get(MARK) if isinstance(metadata.get(MARK), dict) else {}  # save_model's index
    aliases = next((a for a in (metadata.get("aliases"), own.get("aliases")) if isinstance(a, dict)), {})
    return CheckpointFiles(str(index), {k: files[v] for k, v in weight_map.items()}, aliases)


def _from_torchbay(folder: Path) -> CheckpointFiles:
    manifest = read_manifest(folder)
    names = list(manifest["files"])
    if any(n.endswith(".distcp") for n in names):
        raise CheckpointError(f"{folder} was saved with checkpoint.io: dcp, which big-model loading does not read; "
                              f"save the weights with accelerator.save_model(model, dir) (safetensors) and load that")
    stems = sorted({n.split(".safetensors")[0].split("-0")[0] for n in names
                    if n.endswith((".safetensors", ".safetensors.index.json")) and n.startswith("model")})
    if not stems:
        raise CheckpointError(f"{folder} is a torchbay checkpoint without model weights (its manifest lists no "
                              f"model*.safetensors file)")
    if len(stems) > 1:
        raise CheckpointError(f"{folder} holds the weights of {len(stems)} models ({', '.join(stems)}); pass the one "
                              f"to load: its <stem>.safetensors file or <stem>.safetensors.index.json")
    stem = stems[0]
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        return _from_index(index)
    return _single(folder / f"{stem}.safetensors")


def _single(file: Path) -> CheckpointFiles:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except Exception as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None
        aliases = (read_mark(file) or {}).get("aliases")  # tied weights of a save_model file
        return CheckpointFiles(str(file), {k: file for k in keys}, aliases if isinstance(aliases, dict) else {})
    files = CheckpointFiles(str(file), {})
    files.key_file = {k: file for k in files._torch(file)}
    files.files = [file]
    return files


def resolve_checkpoint(checkpoint: str | Path) -> CheckpointFiles:
    """The :class:`CheckpointFiles` of ``checkpoint`` (see the module doc for what is accepted)."""
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _from_index(path)
        if path.suffix == ".safetensors" or path.suffix in TORCH_SUFFIXES:
            return _single(path)
        raise CheckpointError(f"checkpoint {path} is neither a .safetensors file, a torch .bin/.pt file nor a "
                              f"*.index.json index")
    if (path / MANIFEST).exists():
        return _from_torchbay(path)

    newer = newer_of(path / WEIGHTS, path / INDEX)  # an interrupted save_model that changed layout
    if newer is not None:
        return _single(newer) if newer.name == WEIGHTS else _from_index(newer)
    indexes = sorted(p for p in path.glob("*.index.json") if p.name.endswith((".safetensors.index.json",
                                                                             ".bin.index.json")))
    if not indexes and len(list(path.glob("*.index.json"))) == 1:  # one index of another name, as Accelerate reads
        indexes = list(path.glob("*.index.json"))
    safetensor_indexes = [p for p in indexes if p.name.endswith(".safetensors.index.json")]
    if len(safetensor_indexes) > 1 or (not safetensor_indexes and len(indexes) > 1):
        raise CheckpointError(f"{path} holds several indexes ({', '.join(p.name for p in indexes)}); pass the one "
                              f"to load as checkpoint=")
    if indexes:
        return _from_index((safetensor_indexes or indexes)[0])
    singles = sorted(path.glob("*.safetensors")) or sorted(p for s in TORCH_SUFFIXES for p in path.glob(f"*{s}"))
    if len(singles) == 1:
        return _single(singles[0])
    if not singles:
        raise CheckpointError(f"{path} holds no checkpoint: no *.safetensors or torch .bin file, no index, no "
                              f"torchbay manifest")
    raise CheckpointError(f"{path} holds {len(singles)} weight files ({', '.join(p.name for p in singles[:5])}) but "
                          f"no index saying which tensor is where; pass one file, or add a Hugging Face index")
