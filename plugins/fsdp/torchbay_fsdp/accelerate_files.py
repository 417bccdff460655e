"""Accelerate's FSDP checkpoint files, written and read by torchbay-fsdp's strategy.

The layout is Accelerate 1.15's (``save_fsdp_model`` and friends), so a checkpoint written by either
loads on the other:

- FULL_STATE_DICT: ``pytorch_model_fsdp.bin`` (``pytorch_model_fsdp_<i>.bin`` for model i > 0) and
  ``optimizer.bin`` (``optimizer_<j>.bin``): the full state gathered to rank 0 on CPU, ``torch.save``'d by
  rank 0; read by rank 0 with ``weights_only=True`` and broadcast to the shards.
- SHARDED_STATE_DICT: DCP folders ``pytorch_model_fsdp_<i>/`` (entries ``model.<name>``) and
  ``optimizer_<j>/`` (entries ``optimizer.<...>``), every rank writing its shards; read through
  torchbay's restricted DCP reader (:func:`torchbay.storage.safe_load.dcp_load`), onto any number of ranks.

Safety: nothing is unpickled with arbitrary classes. A file torchbay writes is ``torch.save``'d under a
temporary name, fsync'ed and renamed into place; its zip records then sit under the folder name
``torchbay_fsdp...``, which is how torchbay recognises a file it wrote. An existing file of the same
name that torchbay did not write is never overwritten. A DCP folder torchbay writes gets a
``.torchbay_fsdp.json`` beside DCP's files (Accelerate's reader ignores it) listing them with their sizes
and the checksum of ``.metadata``; a non-empty folder is replaced only when it holds exactly those files
unchanged (its listed files are removed first), otherwise the save is refused on every rank before
anything is written. Every rank enters every collective:
a check or a write that fails on one rank is raised on all of them.
"""

from __future__ import annotations

import json
import os
import uuid
import zipfile
from pathlib import Path
from typing import Any

import torch

from torchbay.errors import CheckpointError, ConfigError, TorchbayError
from torchbay.plugin import dcp_load, file_record, fsync_dir, safe_torch_load

MODEL_NAME = "pytorch_model_fsdp"  # Accelerate's FSDP_MODEL_NAME
OPTIMIZER_NAME = "optimizer"  # Accelerate's OPTIMIZER_NAME
#: the first part of the zip folder name inside every .bin torchbay writes (torch names it after the file)
OWN_ARCHIVE = "torchbay_fsdp"
#: written beside DCP's files in a folder torchbay-fsdp saved: what it wrote there
DCP_MARK = ".torchbay_fsdp.json"


def is_full(plugin: Any) -> bool:
    return "FULL_STATE_DICT" in str(plugin.state_dict_type)


def model_file(i: int) -> str:
    return f"{MODEL_NAME}.bin" if i == 0 else f"{MODEL_NAME}_{i}.bin"


def optimizer_file(j: int) -> str:
    return f"{OPTIMIZER_NAME}.bin" if j == 0 else f"{OPTIMIZER_NAME}_{j}.bin"


def _dcp_dir(base: Path, name: str) -> Path:
    """Accelerate's rule: ``base/name`` unless ``base`` already is that folder."""
    return base if base.name == name else base / name


def written_by_torchbay(path: Path) -> bool:
    """Whether ``path`` is a torch zip file whose records torchbay's :func:`_save_file` named."""
    try:
        with zipfile.ZipFile(path) as archive:
            first = archive.namelist()[0] if archive.namelist() else ""
    except (OSError, zipfile.BadZipFile):
        return False
    return first.startswith(OWN_ARCHIVE)


def _dcp_entries(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.name != DCP_MARK and p.is_file()}


def dcp_folder_is_own(folder: Path) -> bool:
    """Whether ``folder`` holds exactly the DCP files torchbay-fsdp wrote there, unchanged since."""
    try:
        mark = json.loads((folder / DCP_MARK).read_text(encoding="utf-8"))
        others = [p.name for p in folder.iterdir() if not p.is_file()]
        return (not others and mark.get("writer") == "torchbay-fsdp" and _dcp_entries(folder) == mark["files"]
                and file_record(folder / ".metadata", sync=False)["xxh3_128"] == mark["metadata_xxh3_128"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


def _options(plugin: Any, full: bool, *, load: bool, world_size: int, adapter_only: bool = False, model: Any = None):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    adapter = bool(adapter_only and model is not None and _is_peft(model))
    offload = bool(getattr(plugin.state_dict_config, "offload_to_cpu", True)) if not full else True
    return StateDictOptions(full_state_dict=full, cpu_offload=offload if (not load or not full) else False,
                            broadcast_from_rank0=full and load and world_size > 1,
                            ignore_frozen_params=adapter and not load, strict=not adapter)


class AccelerateFiles:
    """The four operations, for one :class:`~torchbay_fsdp.strategy.FSDPStrategy`."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    # -- agreement between ranks ----------------------------------------------------------
    def _agree(self, problem: str | None, what: str) -> None:
        """Raise on every rank when any rank has a problem (one collective, entered by all)."""
        problems = self.strategy.all_gather_object(problem) if self.strategy.world_size > 1 else [problem]
        found = [(rank, p) for rank, p in enumerate(problems) if p]
        if found:
            rank, text = found[0]
            text = text if text.startswith(what) else f"{what}: {text}"
            raise CheckpointError(text + (f" (rank {rank})" if self.strategy.world_size > 1 else ""))

    def _attempt(self, fn, what: str) -> Any:
        """``fn()`` on this rank, then agree: an exception on one rank is raised on all."""
        try:
            result, problem = fn(), None
        except Exception as exc:  # noqa: BLE001 (reported on every rank below)
            result, problem = None, str(exc) if isinstance(exc, TorchbayError) else f"{type(exc).__name__}: {exc}"
        self._agree(problem, what)
        return result

    @staticmethod
    def _use_dcp(use_dcp: bool, what: str) -> None:
        if not use_dcp:
            raise ConfigError(f"{what}(use_dcp=False): torchbay writes and reads sharded FSDP state with "
                              f"torch.distributed.checkpoint only (per-rank pickles cannot be read safely); "
                              f"pass use_dcp=True (the default)")

    def _check_target(self, path: Path, folder: bool) -> str | None:
        if folder:
            if path.is_symlink() or path.is_file():
                return (f"{path} exists and is not a folder torchbay can write DCP shards into; "
                        "remove it or save elsewhere")
            if path.is_dir() and any(path.iterdir()) and not dcp_folder_is_own(path):
                return (f"{path} holds files torchbay did not write (or changed since; its {DCP_MARK} lists what it "
                        f"wrote), which it does not overwrite; remove the folder or save into a new directory")
            return None
        if path.is_symlink() or path.is_dir():
            return f"{path} exists and is not a file torchbay wrote; remove it or save elsewhere"
        if path.exists() and not written_by_torchbay(path):
            return (f"{path} exists and was not written by torchbay, which does not overwrite it; remove it or save "
                    f"into a new directory")
        return None

    def _save_file(self, obj: Any, path: Path) -> None:
        """``torch.save`` under a temporary name (its records named ``torchbay_fsdp...``), fsync, rename."""
        temp = path.parent / f"{OWN_ARCHIVE}-{uuid.uuid4().hex[:12]}.partial"
        try:
            torch.save(obj, temp)
            with open(temp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(temp, path)
        finally:
            if temp.exists():
                temp.unlink()
        fsync_dir(path.parent)

    def _prepare_dir(self, output_dir: Any) -> Path:
        out = Path(output_dir)
        self._attempt(lambda: out.mkdir(parents=True, exist_ok=True), f"creating {out}")
        return out

    # -- model ---------------------------------------------------------------------------
    def save_model(self, plugin: Any, model: Any, output_dir: Any, index: int = 0, *, adapter_only: bool = False,
                   use_dcp: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        s = self.strategy
        full = is_full(plugin)
        if not full:
            self._use_dcp(use_dcp, "save_fsdp_model")
        out = self._prepare_dir(output_dir)
        target = out / (model_file(index) if full else f"{MODEL_NAME}_{index}")
        self._agree(self._check_target(target, folder=not full) if s.rank == 0 else None, "save_fsdp_model")
        options = _options(plugin, full, load=False, world_size=s.world_size, adapter_only=adapter_only, model=model)
        state = get_model_state_dict(model, options=options)  # collective
        if full:
            self._attempt(lambda: self._save_file(state, target) if s.rank == 0 else None, "save_fsdp_model")
        else:
            self._save_dcp({"model": state}, target, "save_fsdp_model")

    def load_model(self, plugin: Any, model: Any, input_dir: Any, index: int = 0, *, adapter_only: bool = False,
                   use_dcp: bool = True) -> Any:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        s = self.strategy
        full = is_full(plugin)
        base = Path(input_dir)
        options = _options(plugin, full, load=True, world_size=s.world_size, adapter_only=adapter_only, model=model)
        s.barrier()
        if full:
            path = base / model_file(index)
            state = self._attempt(lambda: self._read_file(path, "load_fsdp_model") if s.rank == 0 or s.world_size == 1
                                  else {}, "load_fsdp_model")
        else:
            self._use_dcp(use_dcp, "load_fsdp_model")
            folder = _dcp_dir(base, f"{MODEL_NAME}_{index}")
            self._agree(None if (folder / ".metadata").is_file() else
                        f"{folder} is not a DCP checkpoint (no .metadata); was it saved with FULL_STATE_DICT "
                        f"({model_file(index)})? Set the plugin's state_dict_type to match", "load_fsdp_model")
            state = self._load_dcp({"model": get_model_state_dict(model, options=options)}, folder)["model"]
        try:
            result = set_model_state_dict(model, state, options=options)  # collective
        except Exception as exc:
            raise CheckpointError(f"load_fsdp_model: the state in {base} does not fit the prepared model: "
                                  f"{type(exc).__name__}: {exc}") from exc
        s.barrier()
        return result

    # -- optimizer -----------------------------------------------------------------------
    def save_optimizer(self, plugin: Any, optimizer: Any, model: Any, output_dir: Any, index: int = 0, *,
                       use_dcp: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        s = self.strategy
        full = is_full(plugin)
        if not full:
            self._use_dcp(use_dcp, "save_fsdp_optimizer")
        out = self._prepare_dir(output_dir)
        target = out / (optimizer_file(index) if full else f"{OPTIMIZER_NAME}_{index}")
        self._agree(self._check_target(target, folder=not full) if s.rank == 0 else None, "save_fsdp_optimizer")
        raw = getattr(optimizer, "optimizer", optimizer)
        state = get_optimizer_state_dict(model, raw, options=_options(plugin, full, load=False,
                                                                      world_size=s.world_size))  # collective
        if full:
            self._attempt(lambda: self._save_file(state, target) if s.rank == 0 else None, "save_fsdp_optimizer")
        else:
            self._save_dcp({"optimizer": state}, target, "save_fsdp_optimizer")

    def load_optimizer(self, plugin: Any, optimizer: Any, model: Any, input_dir: Any, index: int = 0, *,
                       use_dcp: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        s = self.strategy
        full = is_full(plugin)
        base = Path(input_dir)
        raw = getattr(optimizer, "optimizer", optimizer)
        options = _options(plugin, full, load=True, world_size=s.world_size)
        s.barrier()
        if full:
            path = base / optimizer_file(index)
            state = self._attempt(lambda: self._read_file(path, "load_fsdp_optimizer")
                                  if s.rank == 0 or s.world_size == 1 else {}, "load_fsdp_optimizer")
        else:
            self._use_dcp(use_dcp, "load_fsdp_optimizer")
            folder = _dcp_dir(base, f"{OPTIMIZER_NAME}_{index}")
            self._agree(None if (folder / ".metadata").is_file() else
                        f"{folder} is not a DCP checkpoint (no .metadata); was it saved with FULL_STATE_DICT "
                        f"({optimizer_file(index)})? Set the plugin's state_dict_type to match", "load_fsdp_optimizer")
            current = get_optimizer_state_dict(model, raw, options=options)
            state = self._load_dcp({"optimizer": current}, folder)["optimizer"]
        try:
            set_optimizer_state_dict(model, raw, state, options=options)  # collective
        except Exception as exc:
            raise CheckpointError(f"load_fsdp_optimizer: the state in {base} does not fit the optimizer: "
                                  f"{type(exc).__name__}: {exc}") from exc
        s.barrier()

    # -- files ---------------------------------------------------------------------------
    def _read_file(self, path: Path, what: str) -> dict:
        trusted = bool(getattr(self.strategy.context.config.checkpoint, "allow_unsafe_pickle", False))
        return safe_torch_load(path, what, trusted=trusted)

    def _save_dcp(self, state: dict, folder: Path, what: str) -> None:
        """DCP into ``folder`` (absent, empty, or checked by rank 0 to hold only what torchbay wrote there)."""
        import torch.distributed.checkpoint as dcp

        def clear() -> None:
            folder.mkdir(parents=True, exist_ok=True)
            if self.strategy.rank == 0 and (folder / DCP_MARK).exists():  # our previous save: its files only
                for name in _dcp_entries(folder):
                    (folder / name).unlink()
                (folder / DCP_MARK).unlink()

        self._attempt(clear, what)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))  # collective; DCP agrees on failures
        self._attempt(lambda: self._mark(folder) if self.strategy.rank == 0 else None, what)

    @staticmethod
    def _mark(folder: Path) -> None:
        mark = {"writer": "torchbay-fsdp", "files": _dcp_entries(folder),
                "metadata_xxh3_128": file_record(folder / ".metadata", sync=False)["xxh3_128"]}
        temp = folder / f"{DCP_MARK}.{uuid.uuid4().hex[:12]}.partial"
        temp.write_text(json.dumps(mark, indent=1), encoding="utf-8")
        os.replace(temp, folder / DCP_MARK)
        fsync_dir(folder)

    def _load_dcp(self, state: dict, folder: Path) -> dict:
        trusted = bool(getattr(self.strategy.context.config.checkpoint, "allow_unsafe_pickle", False))
        return dcp_load(state, folder, trusted=trusted)
