"""``save_model``'s folder: the files Accelerate's ``save_model`` writes, and nothing else.

``model.safetensors``; or shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``,
keys sorted, as Accelerate writes it). Every safetensors header has ``"format": "pt"``. With
``safe_serialization=False``, the same in torch's format: ``pytorch_model.bin`` or
``pytorch_model-0000i-of-0000N.bin`` shards and ``pytorch_model.bin.index.json``.

What torchbay needs to know travels inside those files, under the key ``torchbay``: in each
safetensors header's metadata (a JSON string), in the index's ``metadata``, and in a ``.bin``
as one more JSON record of its zip archive (``<archive>/torchbay.json``, which torch's loader
never reads): the torchbay version, an id shared by every file of one save, tied-weight aliases
and the caller's fields. That entry is how torchbay recognises its own files (read as JSON,
never unpickled): it replaces or removes a weights file of the folder only when the file carries
it, and refuses, before writing anything, a folder holding a weights file it did not write. Any
other file (a ``config.json``, a tokenizer saved next to the weights) is left alone, as
Accelerate leaves it. A foreign ``.bin`` beside new safetensors is left too (loaders prefer
safetensors); a foreign safetensors file beside a new ``.bin`` is refused (it would be loaded
instead).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchbay.errors import CheckpointError
from torchbay.registry.info import _own_version as version
from torchbay.storage.files import dedupe_shared
from torchbay.storage.files import fsync_dir as fsync_path

log = logging.getLogger("torchbay")

MARK = "torchbay"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: the record torchbay adds to the zip archive of a ``.bin`` it writes
BIN_MARK_RECORD = "torchbay.json"


@dataclass(frozen=True)
class WeightsFormat:
    """The names of one weights format's files."""

    single: str
    index: str
    shard: re.Pattern
    pattern: str  # huggingface_hub's filename_pattern

    def names(self, name: str) -> bool:
        return name in (self.single, self.index) or self.shard.fullmatch(name) is not None


SAFETENSORS = WeightsFormat(WEIGHTS, INDEX, SHARD, "model{suffix}.safetensors")
PYTORCH = WeightsFormat("pytorch_model.bin", "pytorch_model.bin.index.json",
                        re.compile(r"pytorch_model-\d{5}-of-\d{5}\.bin"), "pytorch_model{suffix}.bin")
TEMPORARY = ".torchbay-tmp-"
#: a safetensors header or an index larger than this is not read to look for the mark
MAX_HEADER = 100 << 20


def is_weights_name(name: str) -> bool:
    """A name ``save_model`` writes (and so may replace or remove when the file is torchbay's)."""
    return SAFETENSORS.names(name) or PYTORCH.names(name)


def read_mark(path: Path) -> dict[str, Any] | None:
    """torchbay's entry in a safetensors header or an index; ``None`` when it has none or cannot be read.

    Only JSON is parsed (the header's length, then the header): a damaged or foreign file is
    simply not torchbay's.
    """
    try:
        if path.name.endswith(".bin"):
            mark = _read_bin_mark(path)
            return mark if isinstance(mark, dict) and mark.get("save") else None
        with open(path, "rb") as fp:
            if path.name.endswith(".json"):
                data = fp.read(MAX_HEADER + 1)
                metadata = json.loads(data).get("metadata", {}) if len(data) <= MAX_HEADER else {}
                mark = metadata.get(MARK) if isinstance(metadata, dict) else None
            else:
                (length,) = struct.unpack("<Q", fp.read(8))
                if length > MAX_HEADER:
                    return None
                metadata = json.loads(fp.read(length)).get("__metadata__") or {}
                mark = json.loads(metadata[MARK]) if isinstance(metadata.get(MARK), str) else None
    except (OSError, ValueError, AttributeError, struct.error, UnicodeDecodeError, zipfile.BadZipFile):
        return None
    return mark if isinstance(mark, dict) and mark.get("save") else None


def _read_bin_mark(path: Path) -> Any:
    with zipfile.ZipFile(path) as archive:
        records = [info for info in archive.infolist() if info.filename.endswith("/" + BIN_MARK_RECORD)]
        if len(records) != 1 or records[0].file_size > MAX_HEADER:
            return None
        return json.loads(archive.read(records[0]))


def _save_bin(tensors: dict[str, torch.Tensor], path: Path, mark: dict[str, Any]) -> None:
    """torch.save, then torchbay's entry as one more record of the archive (see the module docstring)."""
    torch.save(tensors, path)
    with zipfile.ZipFile(path, "a") as archive:
        prefix = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{prefix}/{BIN_MARK_RECORD}", json.dumps(mark, sort_keys=True))


class ModelFolder:
    """The folder one ``save_model`` (or ``torchbay merge-weights``) writes into."""

    def __init__(self, directory: Path, what: str = "save_model"):
        self.directory = Path(directory).absolute()
        self.what = what

    def save(self, state: dict[str, torch.Tensor], max_shard_size: str | int,
             fields: dict[str, Any] | None = None, safe_serialization: bool = True) -> list[str]:
        """Write ``state`` as Accelerate's ``save_model`` does; the names written."""
        from huggingface_hub import split_torch_state_dict_into_shards

        fmt = SAFETENSORS if safe_serialization else PYTORCH
        self._open()
        previous = self._own_weights_files(fmt)
        self._remove_own_temporaries()
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        aliases: dict[str, str] = {}
        if fmt is SAFETENSORS:  # a file of it holds each tensor once; torch's pickle keeps ties itself
            tensors, aliases = dedupe_shared(tensors)
        tensors = {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}
        split = split_torch_state_dict_into_shards(tensors, filename_pattern=fmt.pattern,
                                                   max_shard_size=max_shard_size)
        mark = {"version": _own_version(), "save": uuid.uuid4().hex, "created": time.time(), **(fields or {})}
        if fmt is PYTORCH:  # loaders prefer safetensors: torchbay's earlier ones go before the .bin files come
            for name in [n for n in previous if SAFETENSORS.names(n)]:
                self._remove_own(name)
        written = []
        for filename, names in split.filename_to_tensors.items():
            file_mark = dict(mark, aliases=aliases) if not split.is_sharded else mark
            part = {n: tensors[n] for n in names}
            if fmt is SAFETENSORS:
                self._write_safetensors(filename, part, file_mark)
            else:
                self._write(filename, lambda path, part=part, file_mark=file_mark: _save_bin(part, path, file_mark))
            written.append(filename)
        if split.is_sharded:
            if fmt.single in previous:  # loaders prefer a single file to an index: it goes before the index comes
                self._remove_own(fmt.single)
            index = {"metadata": {**split.metadata, MARK: dict(mark, aliases=aliases)},
                     "weight_map": split.tensor_to_filename}
            self._write(fmt.index, lambda path: path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                                  encoding="utf-8"))
            written.append(fmt.index)
        stale = sorted(set(previous) - set(written), key=lambda name: not name.endswith(".json"))  # indexes first
        for name in stale:
            self._remove_own(name)
        fsync_path(self.directory)
        return written

    # -- steps ----------------------------------------------------------------------------
    def _open(self) -> None:
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.what}: {self.directory} is a file, not a directory; give the folder to "
                                  f"write the weights into")
        self.directory.mkdir(parents=True, exist_ok=True)

    def _own_weights_files(self, fmt: WeightsFormat) -> list[str]:
        """The weights files already there that torchbay wrote (either format); raise, before writing, if one
        of ``fmt``'s names (or, for ``.bin`` files, a safetensors name, which loaders would prefer) is not."""
        own, foreign = [], []
        for entry in sorted(self.directory.iterdir()):
            if not is_weights_name(entry.name):
                continue
            if not (entry.is_symlink() or not entry.is_file() or read_mark(entry) is None):
                own.append(entry.name)
            elif fmt.names(entry.name) or SAFETENSORS.names(entry.name):
                foreign.append(entry.name)
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise CheckpointError(
                f"{self.what}: {self.directory} holds {shown}, which torchbay did not write (no '{MARK}' entry in "
                f"its metadata); torchbay never overwrites such a file, nor leaves it beside new weights for a "
                f"loader to pick up: move it away or save to another folder. Nothing was written.")
        return own

    def _remove_own_temporaries(self) -> None:
        """Temporary files an interrupted save left, removed when they carry torchbay's entry."""
        for entry in self.directory.glob(TEMPORARY + "*"):
            if entry.is_file() and not entry.is_symlink() and read_mark(entry) is not None:
                entry.unlink()
            else:
                log.warning("torchbay: %s looks like a file an interrupted save_model left, but it does not say that "
                            "torchbay wrote it: remove it yourself if it is not yours", entry)

    def _remove_own(self, name: str) -> None:
        path = self.directory / name
        if path.is_file() and not path.is_symlink() and read_mark(path) is not None:  # still the file checked
            path.unlink()

    def _write_safetensors(self, name: str, tensors: dict[str, torch.Tensor], mark: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        metadata = {"format": "pt", MARK: json.dumps(mark, sort_keys=True)}
        self._write(name, lambda path: save_file(tensors, str(path), metadata=metadata))

    def _write(self, name: str, write) -> None:
        """``write(path)`` a new temporary file, fsync it, rename it to ``name``."""
        temporary = self.directory / f"{TEMPORARY}{uuid.uuid4().hex[:12]}-{name}"
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # a name nobody else has
        try:
            write(temporary)
            fsync_path(temporary)
            os.replace(temporary, self.directory / name)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def newer_of(single: Path, index: Path) -> Path | None:
    """Of a ``model.safetensors`` and an index both written by torchbay (a save that changed layout
    and was interrupted before it removed the other), the one saved last; else ``None``."""
    marks = read_mark(single), read_mark(index)
    if None in marks:
        return None
    return single if float(marks[0].get("created", 0)) >= float(marks[1].get("created", 0)) else index


def check_one_save(index: Path, files: list[Path]) -> None:
    """Raise when a torchbay index and the shards it names come from different saves (a save
    interrupted between writing its shards and its index)."""
    index_mark = read_mark(index)
    if index_mark is None:
        return
    others = sorted(f.name for f in files if (read_mark(f) or {}).get("save") != index_mark["save"])
    if others:
        raise CheckpointError(f"{index} and {', '.join(others[:5])} come from different saves (a save_model was "
                              f"interrupted, or files were copied in from another save); save the model again")


def _own_version() -> str:
    return version()
