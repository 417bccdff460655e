"""The FSDP strategy's checkpoints: the full (unsharded) state dict on rank 0, sharded checkpoints through DCP (also
asynchronous), and Accelerate's FSDP file functions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchbay.errors import CheckpointError
from torchbay.plugin import dcp_files_of_rank, dcp_load, optimizer_owners
from torchbay_fsdp.accelerate_files import AccelerateFiles
from torchbay_fsdp.accelerate_plugin import FullyShardedDataParallelPlugin
from torchbay_fsdp.async_checkpoint import AgreedStart, HostStaging
from torchbay_fsdp.layout import INFO_FILE, model_dir, optimizer_dir

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.plugin import CheckpointIO, DeviceBackend, RunContext
    from torchbay_fsdp.config import FSDPConfig


class FSDPCheckpoint:
    """FSDP's state: full state dicts, sharded DCP checkpoints, and Accelerate's FSDP surface
    (``accelerator.state.fsdp_plugin``, ``save_fsdp_model`` and friends); a mixin of
    :class:`~torchbay_fsdp.strategy.FSDPStrategy`."""

    # what it reads of the strategy (the Strategy base's and FSDPStrategy's own, made in its __init__)
    context: RunContext
    settings: FSDPConfig
    device_backend: DeviceBackend
    rank: int
    world_size: int
    sizes: dict[str, int]  # the parallel dimensions' sizes (written in the checkpoint's info file)

    # -- state --------------------------------------------------------------------------
    def model_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0 (CPU tensors), empty elsewhere; every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # -- Accelerate's FSDP surface (accelerator.state.fsdp_plugin, save_fsdp_model and friends) -------------
    def accelerate_state_objects(self) -> dict[str, Any]:
        """``accelerator.state.fsdp_plugin``: the user's ``FullyShardedDataParallelPlugin`` (its unset fields
        filled from the ``fsdp`` section), or one built from the section."""
        if self._accelerate_plugin is None:
            given = self.context.plugin_objects.get("fsdp_plugin")
            if isinstance(given, FullyShardedDataParallelPlugin):
                given.fill_from(self.settings)
                self._accelerate_plugin = given
            else:
                self._accelerate_plugin = FullyShardedDataParallelPlugin.from_settings(self.settings)
        return {"fsdp_plugin": self._accelerate_plugin}

    def _accelerate_files(self):
        return AccelerateFiles(self)

    def save_accelerate_model(self, plugin, model, output_dir, index: int = 0, **kwargs) -> None:
        """Accelerate's ``save_fsdp_model`` files (FULL_STATE_DICT or SHARDED_STATE_DICT); collective."""
        self._accelerate_files().save_model(plugin, model, output_dir, index, **kwargs)

    def load_accelerate_model(self, plugin, model, input_dir, index: int = 0, **kwargs) -> Any:
        """Read Accelerate's ``save_fsdp_model`` files into the sharded model; collective."""
        return self._accelerate_files().load_model(plugin, model, input_dir, index, **kwargs)

    def save_accelerate_optimizer(self, plugin, optimizer, model, output_dir, index: int = 0, **kwargs) -> None:
        """Accelerate's ``save_fsdp_optimizer`` files; collective."""
        self._accelerate_files().save_optimizer(plugin, optimizer, model, output_dir, index, **kwargs)

    def load_accelerate_optimizer(self, plugin, optimizer, model, input_dir, index: int = 0, **kwargs) -> None:
        """Read Accelerate's ``save_fsdp_optimizer`` files; collective."""
        self._accelerate_files().load_optimizer(plugin, optimizer, model, input_dir, index, **kwargs)

    @staticmethod
    def _owner(j: int, models: list, owners: list[int | None] | None, optimizers: list) -> torch.nn.Module:
        index = (owners or optimizer_owners(models, optimizers))[j]
        if index is None:
            raise CheckpointError("an optimizer's parameters do not all belong to one prepared model; fsdp "
                                  "checkpoints each optimizer with its model: use one optimizer per model")
        return models[index]

    def save_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO, *,
                        owners: list[int | None] | None = None) -> list[str]:
        """Every rank writes its own shards of each model and optimizer (torch.distributed.checkpoint)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        written: list[str] = []
        for i, model in enumerate(models):
            dcp.save(self._for_dcp(model, get_model_state_dict(model)), checkpoint_id=str(directory / model_dir(i)))
            written += dcp_files_of_rank(directory, model_dir(i))
        for j, opt in enumerate(optimizers):
            state = self._dcp_optimizer_state(self._owner(j, models, owners, optimizers), opt)
            dcp.save(state, checkpoint_id=str(directory / optimizer_dir(j)))
            written += dcp_files_of_rank(directory, optimizer_dir(j))
        return written + self._write_info(directory, models, optimizers)

    def _for_dcp(self, model: Any, state: dict) -> dict:
        """What DCP saves and loads for ``state`` (``model``'s state dict, or its optimizer's); a load fills it in
        place, then :meth:`_from_dcp` maps it back. Here ``state`` itself; the strategy's expert parallel overrides
        both (:mod:`torchbay_fsdp.experts.checkpoint`)."""
        return state

    def _from_dcp(self, model: Any, loaded: dict, state: dict) -> dict:
        """``loaded`` (``_for_dcp(model, state)`` after a DCP load) as what ``set_*_state_dict`` takes."""
        return loaded

    def _dcp_optimizer_state(self, owner: Any, opt: Any) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return self._for_dcp(owner, get_optimizer_state_dict(owner, getattr(opt, "optimizer", opt)))

    def _write_info(self, directory: Path, models: list, optimizers: list) -> list[str]:
        if self.rank != 0:
            return []
        info = {"format": "torch.distributed.checkpoint", "fsdp_version": self.settings.version,
                "world_size": self.world_size, "mesh": {n: v for n, v in self.sizes.items() if v > 1},
                "models": [model_dir(i) for i in range(len(models))],
                "optimizers": [optimizer_dir(j) for j in range(len(optimizers))]}
        (directory / INFO_FILE).write_text(json.dumps(info, indent=2))
        return [INFO_FILE]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_checkpoint_groups", None)  # process groups of this process: they do not pickle
        state.pop("_checkpoint_staging", None)  # host memory of this process's asynchronous saves
        return state

    def can_start_checkpoint(self) -> bool:
        return True  # save_state(blocking=False): FSDP2 and FSDP1 (torchbay_fsdp.async_checkpoint)

    def start_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO, *,
                         owners: list[int | None] | None = None):
        """Copy this rank's shards of each model and optimizer to host memory in the call (the memory of
        the last save, reused unless a write from it still runs); once every rank holds its copy, write
        each with DCP in a thread of its own, whose collectives run on a gloo group of that save's own
        (created once, by every rank, on the main thread), never the training's
        (:mod:`torchbay_fsdp.async_checkpoint`)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        groups = self.__dict__.setdefault("_checkpoint_groups", {})

        def group(stem: str):  # one per DCP save: the saves run at once, each in its own thread
            if stem not in groups:
                groups[stem] = dist.new_group(backend="gloo")
            return groups[stem]

        staging = self.__dict__.get("_checkpoint_staging")
        if staging is None or staging.in_use():  # a write still reading it keeps it: stage into new memory
            staging = HostStaging(pin_memory=bool(getattr(self.device_backend, "pinned_staging", False)))
            self._checkpoint_staging = staging
        writes = AgreedStart(self, directory, staging)
        for i, model in enumerate(models):
            writes.stage(model_dir(i), lambda model=model: self._for_dcp(model, get_model_state_dict(model)))
        for j, opt in enumerate(optimizers):
            writes.stage(optimizer_dir(j), lambda j=j, opt=opt: self._dcp_optimizer_state(
                self._owner(j, models, owners, optimizers), opt))
        return writes.start(group, lambda: self._write_info(directory, models, optimizers))

    def release_checkpoint_staging(self) -> None:
        self.__dict__.pop("_checkpoint_staging", None)  # writes still running keep their own references

    def load_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO,
                        read: Any = None, *, owners: list[int | None] | None = None) -> None:
        """Load sharded state written by any number of processes (DCP reshards on load).

        A checkpoint written by a strategy that saves full weights (single, ddp) loads its
        model weights too; its optimizer state cannot be mapped onto shards.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        sharded = [(directory / model_dir(i) / ".metadata").exists() for i in range(len(models))]
        for i, is_sharded in enumerate(sharded):  # check every part before changing anything
            if not is_sharded and not io.exists(directory, f"model_{i}"):
                raise CheckpointError(f"model {i}: neither {model_dir(i)}/ (sharded) nor model_{i} weights are in "
                                      f"{directory}")
        for j in range(len(optimizers)):
            if not (directory / optimizer_dir(j) / ".metadata").exists():
                hint = (" (the checkpoint was saved by a strategy that does not shard: its optimizer state is keyed "
                        "by position and cannot be resharded)" if (directory / f"optimizer_{j}.pt").exists() else "")
                raise CheckpointError(f"optimizer {j}: {optimizer_dir(j)}/ is missing from {directory}{hint}")
        for i, model in enumerate(models):
            try:
                if sharded[i]:
                    state = get_model_state_dict(model)
                    loaded = dcp_load(self._for_dcp(model, state), directory / model_dir(i), trusted=io.trusted)
                    set_model_state_dict(model, self._from_dcp(model, loaded, state))
                else:
                    full = io.load_state_dict(directory, f"model_{i}", device="cpu") if self.rank == 0 else {}
                    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                              broadcast_from_rank0=True))
            except Exception as exc:
                raise CheckpointError(f"model {i} in {directory} does not fit the prepared model: "
                                      f"{type(exc).__name__}: {exc}") from exc
        for j, opt in enumerate(optimizers):
            path = directory / optimizer_dir(j)
            raw = getattr(opt, "optimizer", opt)
            owner = self._owner(j, models, owners, optimizers)
            try:
                template = get_optimizer_state_dict(owner, raw)
                names = [list(group.get("params", ())) for group in template.get("param_groups", ())]
                loaded = dcp_load(self._for_dcp(owner, template), path, trusted=io.trusted)
                state = self._from_dcp(owner, loaded, template)
                _keep_parameter_names(state, names)
                set_optimizer_state_dict(owner, raw, state)
            except Exception as exc:
                raise CheckpointError(f"optimizer {j} could not be restored from {path}: "
                                      f"{type(exc).__name__}: {exc}") from exc


def _keep_parameter_names(state: dict, names: list[list[str]]) -> None:
    """Each loaded parameter group keeps this rank's parameter names: the checkpoint's list comes from the rank
    that saved it, which under pipeline parallel (or in a checkpoint saved at another pp size) holds other
    stages' parameters."""
    groups = state.get("param_groups") or []
    if len(groups) == len(names):
        for group, own in zip(groups, names):
            group["params"] = own
