"""Built-in checkpoint io: sharded safetensors (default), torch DCP, and torch's pickle format (``torch``, what
``save_state(safe_serialization=False)`` writes; read back with ``weights_only=True``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torchbay.axes.checkpoint_io import CheckpointIO
from torchbay.errors import CheckpointError
from torchbay.registry.manager import hookimpl
from torchbay.storage.files import dcp_files_of_rank, dedupe_shared
from torchbay.storage.inplace import plan_safetensors, run_reads
from torchbay.storage.safe_load import dcp_load, dcp_load_full, safe_torch_load


class SafetensorsCheckpointIO(CheckpointIO):
    """``<stem>.safetensors``, or shards plus ``<stem>.safetensors.index.json``."""

    name = "safetensors"

    def save_state_dict(self, state, directory: Path, stem: str) -> list[str]:
        from huggingface_hub import split_torch_state_dict_into_shards
        from safetensors.torch import save_file

        # non-tensor entries (e.g. a module's pickled ``_extra_state``) cannot go into safetensors;
        # plugins that need such state save it through torchbay_state_extra
        tensors, aliases = dedupe_shared({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
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
        found = self._files(directory, stem)
        return None if found is None else plan_safetensors(found[0], found[1], template)

    def load_state_dict(self, directory: Path, stem: str, device: str = "cpu", template=None):
        """The tensors of ``stem``; with a ``template`` (a module's ``state_dict()``) they are
        read straight into its tensors when every one fits, and the template is returned."""
        from safetensors.torch import load_file

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
        if template is not None:
            return dcp_load(template, directory / stem, trusted=self.trusted)
        return dcp_load_full(directory / stem, trusted=self.trusted)



class TorchCheckpointIO(CheckpointIO):
    """``<stem>.bin`` written by ``torch.save`` (Accelerate's ``pytorch_model.bin``), main process only.

    Read back with ``torch.load(weights_only=True)``: a file holding anything but tensors and plain data is refused
    (unless ``checkpoint.allow_unsafe_pickle``), so a tampered checkpoint cannot run code when it is loaded.
    """

    name = "torch"

    def save_state_dict(self, state, directory: Path, stem: str) -> list[str]:
        # tensors only, as with safetensors: tied weights stay tied (torch.save keeps shared storage)
        torch.save({k: v.detach().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)},
                   directory / f"{stem}.bin")
        return [f"{stem}.bin"]

    def exists(self, directory: Path, stem: str) -> bool:
        return (directory / f"{stem}.bin").exists()

    def load_state_dict(self, directory: Path, stem: str, device: str = "cpu", template=None):
        return safe_torch_load(directory / f"{stem}.bin", f"model weights '{stem}'", trusted=self.trusted,
                               map_location=device)


@hookimpl
def torchbay_register_checkpoint_io():
    return [SafetensorsCheckpointIO, DCPCheckpointIO, TorchCheckpointIO]
