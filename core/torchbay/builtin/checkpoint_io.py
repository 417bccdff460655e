"""Built-in checkpoint io: sharded safetensors (default) and torch DCP."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torchbay.checkpoint_io import CheckpointIO
from torchbay.errors import CheckpointError
from torchbay.plugins import hookimpl


def _dedupe_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory: keep one name, remember the aliases."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype, tensor.device) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        kept[name] = tensor
    storages: dict[int, int] = {}
    for name, tensor in kept.items():  # partial overlaps (views): copy to stand alone
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
        storages[ptr] = storages.get(ptr, 0) + 1
    for name, tensor in list(kept.items()):
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
        if storages[ptr] > 1:
            kept[name] = tensor.clone()
    return kept, aliases


class SafetensorsCheckpointIO(CheckpointIO):
    """``<stem>.safetensors``, or shards plus ``<stem>.safetensors.index.json``."""

    name = "safetensors"

    def save_state_dict(self, state, directory: Path, stem: str) -> list[str]:
        from huggingface_hub import split_torch_state_dict_into_shards
        from safetensors.torch import save_file

        # non-tensor entries (e.g. a module's pickled ``_extra_state``) cannot go into safetensors;
        # plugins that need such state save it through torchbay_state_extra
        tensors, aliases = _dedupe_shared({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
        tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
        split = split_torch_state_dict_into_shards(tensors, filename_pattern=stem + "{suffix}.safetensors",
                                                   max_shard_size=self.max_shard_size)
        written = []
        for filename, names in split.filename_to_tensors.items():
            save_file({n: tensors[n] for n in names}, str(directory / filename), metadata={"format": "pt"})
            written.append(filename)
        if split.is_sharded or aliases:
            index = {"metadata": {**split.metadata, "aliases": aliases}, "weight_map": split.tensor_to_filename}
            (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
            written.append(f"{stem}.safetensors.index.json")
        return written

    def exists(self, directory: Path, stem: str) -> bool:
        return (directory / f"{stem}.safetensors").exists() or (directory / f"{stem}.safetensors.index.json").exists()

    def _files(self, directory: Path, stem: str) -> tuple[list[Path], dict[str, str]] | None:
        """(files, aliases) of ``stem``; ``None`` when neither a single file nor an index is there."""
        index_path = directory / f"{stem}.safetensors.index.json"
        if index_path.exists():
            index = json.loads(index_path.read_text())
            return ([directory / f for f in sorted(set(index["weight_map"].values()))],
                    dict(index["metadata"].get("aliases", {})))
        single = directory / f"{stem}.safetensors"
        return ([single], {}) if single.exists() else None

    def in_place_reads(self, directory: Path, stem: str, template):
        from torchbay.checkpoint_inplace import plan_safetensors

        found = self._files(directory, stem)
        return None if found is None else plan_safetensors(found[0], found[1], template)

    def load_state_dict(self, directory: Path, stem: str, device: str = "cpu", template=None):
        """The tensors of ``stem``; with a ``template`` (a module's ``state_dict()``) they are
        read straight into its tensors when every one fits, and the template is returned."""
        from safetensors.torch import load_file

        from torchbay.checkpoint_inplace import run_reads

        found = self._files(directory, stem)
        if found is None:
            raise CheckpointError(f"model weights '{stem}' are missing from {directory} "
                                  f"(expected {stem}.safetensors or {stem}.safetensors.index.json)")
        files, aliases = found
        if template is not None:
            reads = self.in_place_reads(directory, stem, template)
            if reads is not None:
                run_reads(reads)
                return template
        state = {}
        for path in files:
            state.update(self._load_file(load_file, path, device))
        for alias, target in aliases.items():
            state[alias] = state[target]
        return state

    @staticmethod
    def _load_file(load_file, path: Path, device: str):
        try:
            return load_file(str(path), device=device)
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc


class DCPCheckpointIO(CheckpointIO):
    """torch.distributed.checkpoint: every rank writes its own part, in parallel (a collective)."""

    name = "dcp"
    collective = True

    def save_state_dict(self, state, directory: Path, stem: str) -> list[str]:
        import warnings

        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # one process without a group is intended here, not worth a warning
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.save(state, checkpoint_id=str(directory / stem))
        return dcp_files_of_rank(directory, stem)

    def exists(self, directory: Path, stem: str) -> bool:
        return (directory / stem / ".metadata").exists()

    def load_state_dict(self, directory: Path, stem: str, device: str = "cpu", template=None):
        from torchbay.safe_load import dcp_load, dcp_load_full

        if template is not None:
            return dcp_load(template, directory / stem, trusted=self.trusted)
        return dcp_load_full(directory / stem, trusted=self.trusted)


def dcp_files_of_rank(directory: Path, stem: str) -> list[str]:
    """The files of DCP checkpoint ``directory/stem`` that this rank wrote (rank 0 also the metadata)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return [f"{stem}/{path.name}" for path in sorted((directory / stem).iterdir())
            if path.name.startswith(f"__{rank}_") or (rank == 0 and not path.name.startswith("__"))]


@hookimpl
def torchbay_register_checkpoint_io():
    return [SafetensorsCheckpointIO, DCPCheckpointIO]
