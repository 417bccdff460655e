"""The DeepSpeed strategy's checkpoints: every engine saves and loads its own checkpoint folder (optimizer and ZeRO
shards included), read through torchbay's restricted unpickler."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from torchbay.errors import CheckpointError
from torchbay.plugin import read_manifest
from torchbay_deepspeed.engine import CHECKPOINT_TAG, EngineRecord, ds_accelerator_env
from torchbay_deepspeed.safe_checkpoint import check_every_file, install_safe_loader


class DeepSpeedCheckpoint:
    """DeepSpeed's state: each engine's own checkpoint (``save_checkpoint``/``load_checkpoint``, pickles read
    through the allow-list), the full state dict for save_model; a mixin of
    :class:`~torchbay_deepspeed.strategy.DeepSpeedStrategy`."""

    # -- state -------------------------------------------------------------------------------
    def _zero3(self, rec: EngineRecord) -> bool:
        return rec.engine is not None and rec.engine.zero_optimization_partition_weights()

    def model_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """Full weights on the main process (gathered layer by layer under ZeRO-3); ``{}`` elsewhere."""
        rec = self._record(model)
        if self._zero3(rec):
            state = rec.engine._zero3_consolidated_16bit_state_dict()
            return dict(state) if state is not None else {}
        return rec.module.state_dict()

    def synchronous_checkpoint_reason(self) -> str:
        """Why ``save_state(blocking=False)`` is synchronous with DeepSpeed (docs/checkpoint-guarantees.md, 6)."""
        version = getattr(sys.modules.get("deepspeed"), "__version__", "")
        engines = sorted({type(rec.engine.checkpoint_engine).__name__ for rec in self.records
                          if rec.engine is not None and getattr(rec.engine, "checkpoint_engine", None) is not None})
        return (f"DeepSpeed {version} writes each engine's checkpoint in the call, collectively "
                f"(this run: {', '.join(engines) or 'TorchCheckpointEngine'}), and none of its checkpoint engines "
                f"offers an asynchronous save torchbay can publish with its guarantees: FastCheckpointEngine also "
                f"writes in the call (and needs libaio), DecoupledCheckpointEngine hands the live tensors to a "
                f"subprocess and commits inside the next engine.step(), DataStates needs the datastates package "
                f"(not on PyPI), Nebula is removed; for asynchronous saves use strategy fsdp")

    def save_checkpoint(self, directory: Path, models: list, optimizers: list, io, *,
                        owners: list[int | None] | None = None) -> list[str]:
        """Every rank writes its part of each engine's DeepSpeed checkpoint to ``deepspeed_model_<i>``."""
        written: list[str] = []
        engine_dirs = []
        for i, model in enumerate(models):
            rec = self._record(model)
            if not rec.trains:  # a frozen model (or one never given an optimizer): its full weights
                state = self.model_state_dict(model)
                if self.rank == 0:
                    written += io.save_state_dict(state, directory, f"model_{i}")
                continue
            rec.engine.save_checkpoint(str(directory / f"deepspeed_model_{i}"), tag=CHECKPOINT_TAG,
                                       client_state={"torchbay_model_index": i}, save_latest=False)
            engine_dirs.append(directory / f"deepspeed_model_{i}")
        self.barrier()  # every rank's DeepSpeed files are written; rank 0 lists them all
        if self.rank != 0:
            return written
        return written + sorted(str(p.relative_to(directory)) for d in engine_dirs for p in d.rglob("*")
                                if p.is_file())

    def load_checkpoint(self, directory: Path, models: list, optimizers: list, io, read: Any = None, *,
                        owners: list[int | None] | None = None) -> None:
        saved_world = read_manifest(directory).get("world_size")
        for i, model in enumerate(models):
            rec = self._record(model)
            sub = directory / f"deepspeed_model_{i}"
            if not rec.trains:
                self._load_full_weights(rec, io.load_state_dict(directory, f"model_{i}", device="cpu"), i)
                continue
            if not (sub / CHECKPOINT_TAG).is_dir():
                raise CheckpointError(f"model {i}: {sub / CHECKPOINT_TAG} is missing; was the checkpoint written "
                                      f"with strategy deepspeed?")
            if not self.section.load_universal and saved_world is not None and saved_world != self.world_size:
                raise CheckpointError(
                    f"{directory} was written by {saved_world} processes and this run has {self.world_size}: "
                    f"DeepSpeed cannot re-partition its ZeRO state by itself. Set deepspeed.load_universal: true "
                    f"to convert it to DeepSpeed's universal checkpoint (in a temporary directory next to it) "
                    f"and load that; by hand: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                    f"{sub / CHECKPOINT_TAG} --output_folder OUTPUT")
            install_safe_loader(rec.engine, io.trusted)
            with self._universal_copy(sub, io.trusted) if self.section.load_universal else \
                    contextlib.nullcontext((sub, CHECKPOINT_TAG)) as (load_dir, tag):
                try:
                    path, _ = rec.engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=True,
                                                         load_optimizer_states=rec.engine.optimizer is not None,
                                                         load_lr_scheduler_states=True)
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(f"model {i}: DeepSpeed could not load {sub}: "
                                          f"{type(exc).__name__}: {exc}") from exc
            if path is None:
                raise CheckpointError(f"model {i}: DeepSpeed found no checkpoint in {sub / CHECKPOINT_TAG}")

    @contextlib.contextmanager
    def _universal_copy(self, sub: Path, trusted: bool):
        """DeepSpeed's universal form of ``sub/ds`` in a temporary directory (rank 0 converts, all load).

        Written beside the checkpoint (every node sees it), never inside it, and removed after loading.
        """
        workdir, error = "", ""
        if self.rank == 0:
            try:
                check_every_file(sub / CHECKPOINT_TAG, trusted)  # the converter unpickles freely
                workdir = tempfile.mkdtemp(prefix=f".{sub.parent.name}.universal-", dir=sub.parent.parent)
                cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                       str(sub / CHECKPOINT_TAG), "--output_folder", str(Path(workdir) / "universal"),
                       "--num_extract_workers", "1", "--num_merge_workers", "1"]
                env = {**os.environ, **ds_accelerator_env(self.device_backend.torch_type())}
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    error = (f"converting {sub / CHECKPOINT_TAG} to a universal checkpoint failed "
                             f"({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            except Exception as exc:
                error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        workdir, error = self.broadcast_object((workdir, error))
        try:
            if error:
                raise CheckpointError(error)
            yield Path(workdir), "universal"
        finally:
            self.barrier()
            if self.rank == 0 and workdir:
                shutil.rmtree(workdir, ignore_errors=True)  # made by mkdtemp above: torchbay's own

    def _load_full_weights(self, rec: EngineRecord, state: dict, index: int) -> None:
        if not self._zero3(rec):
            try:
                rec.module.load_state_dict(state)
            except Exception as exc:
                raise CheckpointError(f"model {index} does not fit the saved weights: {exc}") from exc
            return
        names = dict(rec.module.named_parameters())
        missing = sorted(set(names) - set(state))
        if missing:
            raise CheckpointError(f"model {index}: the checkpoint lacks {', '.join(missing[:5])}")
        for name, param in names.items():  # one full parameter at a time
            with self.deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.rank == 0:
                    param.data.copy_(state[name])
        for name, buf in rec.module.named_buffers():
            if name in state:
                buf.data.copy_(state[name])
