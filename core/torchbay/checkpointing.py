"""Checkpoint io (how tensors reach storage) and ``save_state`` / ``load_state``.

A state directory holds ``torchbay_manifest.json`` (versions, world size, plugins, config,
files), the weights written by the strategy through the selected :class:`CheckpointIO`,
optimizer/scheduler/precision state, RNG state per rank, data-loader positions,
registered objects and plugin extras. It is written under ``<name>.partial`` and renamed
when complete; a directory without a manifest is never loaded. Nothing is unpickled:
tensors come from safetensors or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from torchbay.errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.accelerator import Accelerator

log = logging.getLogger("torchbay")
MANIFEST = "torchbay_manifest.json"
FORMAT_VERSION = 1


class CheckpointIO:
    """Writes and reads one state dict of tensors under a file stem in a directory."""

    name: ClassVar[str] = ""

    def __init__(self, max_shard_size: str = "5GB"):
        self.max_shard_size = max_shard_size

    def save_state_dict(self, state: dict[str, torch.Tensor], directory: Path, stem: str) -> list[str]:
        """Write ``state``; return the file names written (relative to ``directory``)."""
        raise NotImplementedError

    def load_state_dict(self, directory: Path, stem: str, device: str = "cpu") -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def exists(self, directory: Path, stem: str) -> bool:
        raise NotImplementedError


# --- RNG ---------------------------------------------------------------------------------


def capture_rng_state(device_backend) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "device_type": device_backend.torch_type(),
        "device": device_backend.get_rng_state(),
    }


def restore_rng_state(state: dict[str, Any], device_backend) -> None:
    part = "python"
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        part = "numpy"
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
        part = "torch"
        torch.set_rng_state(state["torch"])
        part = f"device ({state.get('device_type')})"
        if state.get("device_type") != device_backend.torch_type():
            raise CheckpointError(f"the checkpoint's device RNG is for '{state.get('device_type')}' but this run "
                                  f"uses '{device_backend.torch_type()}'; load it with device: {state.get('device_type')}")
        device_backend.set_rng_state(state["device"])
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"RNG state part '{part}' could not be restored: {type(exc).__name__}: {exc}") from exc


# --- save / load ---------------------------------------------------------------------------


def _torch_save(obj: Any, path: Path) -> str:
    torch.save(obj, path)
    return path.name


def _torch_load(path: Path, what: str) -> Any:
    if not path.exists():
        raise CheckpointError(f"{what}: {path.name} is missing from {path.parent}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{what}: {path} could not be read safely ({type(exc).__name__}: {exc})") from exc


class StateCheckpointer:
    """``Accelerator.save_state`` / ``load_state``; one per accelerator."""

    def __init__(self, accelerator: Accelerator):
        self.acc = accelerator

    # -- where -----------------------------------------------------------------------
    def checkpoints_root(self) -> Path:
        return Path(self.acc.config.project.project_dir) / "checkpoints"

    def automatic_dirs(self) -> list[Path]:
        root = self.checkpoints_root()
        found = [p for p in root.glob("checkpoint_*") if re.fullmatch(r"checkpoint_\d+", p.name) and (p / MANIFEST).exists()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]))

    def target_for_save(self, output_dir: str | None) -> Path:
        project = self.acc.config.project
        if project.automatic_checkpoint_naming:
            if output_dir is not None:
                raise CheckpointError("project.automatic_checkpoint_naming is on: call save_state() without a "
                                      "directory, or turn automatic naming off")
            return self.checkpoints_root() / f"checkpoint_{self.acc.save_iteration}"
        if output_dir is None:
            raise CheckpointError("save_state() needs a directory, or set project.automatic_checkpoint_naming: true")
        return Path(output_dir)

    # -- save --------------------------------------------------------------------------
    def save(self, output_dir: str | None = None) -> Path:
        acc = self.acc
        if not acc.gradient_state.sync_gradients:
            log.warning("save_state is called inside a gradient accumulation window: the gradients accumulated so "
                        "far are not saved; save after a step where accelerator.sync_gradients is True")
        final = self.target_for_save(output_dir).absolute()
        partial = final.with_name(final.name + ".partial")
        strategy = acc.strategy
        if acc.is_main_process:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        strategy.barrier()
        files = self._write_parts(partial)
        files_per_rank = strategy.all_gather_object(files)
        if acc.is_main_process:
            self._write_manifest(partial, sorted({f for fs in files_per_rank for f in fs}))
            self._publish(partial, final)
            self._rotate()
        strategy.barrier()
        if acc.config.project.automatic_checkpoint_naming:
            acc.save_iteration += 1
        return final

    def _write_parts(self, directory: Path) -> list[str]:
        acc = self.acc
        rank = acc.process_index
        files = acc.strategy.save_checkpoint(directory, acc._models, acc._optimizers, acc.checkpoint_io)
        files.append(_torch_save(capture_rng_state(acc.device_backend), directory / f"rng_state_{rank}.pt"))
        if acc.is_main_process:
            for i, scheduler in enumerate(acc._schedulers):
                files.append(_torch_save(scheduler.state_dict(), directory / f"scheduler_{i}.pt"))
            for i, obj in enumerate(acc._custom_objects):
                files.append(_torch_save(obj.state_dict(), directory / f"custom_checkpoint_{i}.pt"))
            files.append(_torch_save(acc.precision.state_dict(), directory / "precision.pt"))
            files.append(_torch_save(acc._training_state(), directory / "training_state.pt"))
        extras = {}
        for extra in acc.pm.hook.torchbay_state_extra(context=acc.context):
            clash = set(extras) & set(extra or {})
            if clash:
                raise CheckpointError(f"two plugins save the same extra state key(s) {sorted(clash)}")
            extras.update(extra or {})
        if extras:
            files.append(_torch_save(extras, directory / f"plugin_state_{rank}.pt"))
        return files

    def _write_manifest(self, directory: Path, files: list[str]) -> None:
        acc = self.acc
        manifest = {
            "format_version": FORMAT_VERSION,
            "torchbay_version": acc.pm.infos.get("cpu").version if acc.pm.infos.get("cpu") else "?",
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "world_size": acc.num_processes,
            "device": acc.device_backend.name,
            "strategy": acc.strategy.name,
            "precision": acc.precision.describe(),
            "plugins": {n: f"{i.distribution} {i.version}" for n, i in acc.pm.infos.items() if i.status in ("loaded", "builtin")},
            "counts": {"models": len(acc._models), "optimizers": len(acc._optimizers), "schedulers": len(acc._schedulers),
                       "dataloaders": len(acc._dataloaders), "custom_objects": len(acc._custom_objects)},
            "config": acc.config.model_dump(mode="json"),
            "files": files,
        }
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))

    def _publish(self, partial: Path, final: Path) -> None:
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            final.rename(old)
        partial.rename(final)
        if old.exists():
            shutil.rmtree(old)

    def _rotate(self) -> None:
        project = self.acc.config.project
        if not (project.automatic_checkpoint_naming and project.total_limit):
            return
        dirs = self.automatic_dirs()
        for stale in dirs[:-project.total_limit]:  # the newest is always kept
            shutil.rmtree(stale)

    # -- load --------------------------------------------------------------------------
    def target_for_load(self, input_dir: str | None) -> Path:
        if input_dir is not None:
            return Path(input_dir)
        if not self.acc.config.project.automatic_checkpoint_naming:
            raise CheckpointError("load_state() needs a directory, or set project.automatic_checkpoint_naming: true")
        dirs = self.automatic_dirs()
        if not dirs:
            raise CheckpointError(f"no complete checkpoint found under {self.checkpoints_root()}")
        return dirs[-1]

    def load(self, input_dir: str | None = None) -> Path:
        acc = self.acc
        directory = self.target_for_load(input_dir).absolute()
        manifest_path = directory / MANIFEST
        if not manifest_path.exists():
            hint = " (it is an interrupted save)" if directory.name.endswith(".partial") else ""
            raise CheckpointError(f"{directory} is not a complete torchbay checkpoint: {MANIFEST} is missing{hint}")
        manifest = json.loads(manifest_path.read_text())
        self._check_counts(manifest, directory)
        acc.strategy.load_checkpoint(directory, acc._models, acc._optimizers, acc.checkpoint_io)
        for i, scheduler in enumerate(acc._schedulers):
            self._restore(f"scheduler {i}", scheduler.load_state_dict, _torch_load(directory / f"scheduler_{i}.pt", f"scheduler {i}"))
        for i, obj in enumerate(acc._custom_objects):
            self._restore(f"registered object {i}", obj.load_state_dict,
                          _torch_load(directory / f"custom_checkpoint_{i}.pt", f"registered object {i}"))
        self._restore("precision", acc.precision.load_state_dict, _torch_load(directory / "precision.pt", "precision"))
        acc._load_training_state(_torch_load(directory / "training_state.pt", "training state"))
        rank = acc.process_index
        rng_file = directory / f"rng_state_{rank}.pt"
        saved_world = int(manifest["world_size"])
        if not rng_file.exists() and rank >= saved_world:
            # more processes than saved it: the strategy has restored (or refused) the weights; this
            # rank takes the RNG stream of a saved rank, so its random draws repeat that rank's
            rng_file = directory / f"rng_state_{rank % saved_world}.pt"
            log.warning("rank %d: the checkpoint was written by %d process(es); this rank resumes with the RNG "
                        "state of rank %d", rank, saved_world, rank % saved_world)
        if not rng_file.exists():
            raise CheckpointError(f"RNG state of rank {rank} is missing from {directory} ({rng_file.name})")
        restore_rng_state(_torch_load(rng_file, f"RNG state of rank {rank}"), acc.device_backend)
        extra_file = directory / f"plugin_state_{rank}.pt"
        if acc.pm.hook.torchbay_load_state_extra.get_hookimpls():
            extras = _torch_load(extra_file, "plugin state") if extra_file.exists() else {}
            acc.pm.hook.torchbay_load_state_extra(context=acc.context, state=extras)
        if acc.config.project.automatic_checkpoint_naming and re.fullmatch(r"checkpoint_\d+", directory.name):
            acc.save_iteration = int(directory.name.split("_")[1]) + 1
        return directory

    def _check_counts(self, manifest: dict, directory: Path) -> None:
        acc = self.acc
        ours = {"models": len(acc._models), "optimizers": len(acc._optimizers), "schedulers": len(acc._schedulers),
                "dataloaders": len(acc._dataloaders), "custom_objects": len(acc._custom_objects)}
        theirs = manifest.get("counts", {})
        wrong = [f"{k}: checkpoint has {theirs.get(k)}, this run prepared {v}" for k, v in ours.items() if theirs.get(k) != v]
        if wrong:
            raise CheckpointError(f"{directory} does not match what was prepared ({'; '.join(wrong)}); "
                                  f"prepare and register the same objects in the same order as the run that saved it")

    @staticmethod
    def _restore(what: str, load, state) -> None:
        try:
            load(state)
        except Exception as exc:
            raise CheckpointError(f"{what} could not be restored: {type(exc).__name__}: {exc}") from exc
