"""Loading a saved state: the folder to load, verified against its manifest before anything changes, the files
read ahead on every rank, then restored into the prepared objects (or an Accelerate folder, read as Accelerate
wrote it)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchbay.checkpoint.accelerate_folder import is_accelerate_state, load_accelerate_state
from torchbay.distributed.rng import restore_rng_state
from torchbay.errors import CheckpointError
from torchbay.storage import files as ckfiles
from torchbay.storage import publish as ckdir
from torchbay.storage.publish import AUTOMATIC_NAME

log = logging.getLogger("torchbay")

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.checkpoint.inputs import CheckpointServices, PreparedObjects, TrainingState


class StateRestore:
    """The load half of :class:`~torchbay.checkpoint.checkpointer.StateCheckpointer`: find, verify, read ahead,
    restore.

    Given, as the checkpointer is: the run's selected objects, the prepared objects and the training state."""

    run: CheckpointServices
    prepared: PreparedObjects
    training: TrainingState

    # -- load --------------------------------------------------------------------------
    def target_for_load(self, input_dir: str | None) -> Path:
        if input_dir is not None:
            return Path(input_dir).absolute()
        if not self.run.config.project.automatic_checkpoint_naming:
            raise CheckpointError("load_state() needs a directory, or set project.automatic_checkpoint_naming: true")
        dirs = self.automatic_dirs()
        if not dirs:
            raise CheckpointError(f"no complete checkpoint found under {self.checkpoints_root()}")
        return dirs[-1][0]

    def load(self, input_dir: str | None = None) -> Path:
        run = self.run
        self.finish_pending()  # a save in flight is published (or has failed) before anything is read
        directory = self.main_only("load_state", lambda: self.target_for_load(input_dir))

        if self.main_only("load_state", lambda: is_accelerate_state(directory)):  # no manifest: Accelerate's folder
            load_accelerate_state(self, directory)
            return directory
        manifest = self.on_every_rank("load_state", lambda: self._check(directory))
        io = self.on_every_rank("load_state", lambda: self.io_named(manifest.get("checkpoint_io")))
        with self.using_io(io):  # the io that wrote the weights (save_state(safe_serialization=False): torch's)
            self._load_models_and_optimizers(directory, manifest)
        self.on_every_rank("load_state", lambda: self._restore_local(directory, manifest))
        if run.config.project.automatic_checkpoint_naming and AUTOMATIC_NAME.fullmatch(directory.name):
            self.training.save_iteration = int(directory.name.split("_")[1]) + 1
        return directory

    def _load_models_and_optimizers(self, directory: Path, manifest: dict) -> None:
        run, prepared = self.run, self.prepared
        read = self.on_every_rank("load_state", lambda: self._read_verified(directory, manifest))
        args = (directory, prepared.models, prepared.optimizers, run.checkpoint_io)
        owners = self._owners()
        self.on_every_rank("load_state", lambda: run.strategy.load_checkpoint(*args, owners=owners) if read is None
                           else run.strategy.load_checkpoint(*args, read=read, owners=owners))

    def _check(self, directory: Path) -> dict:
        """The manifest, the object counts and every listed file's presence."""
        manifest = ckdir.read_manifest(directory)
        if manifest.get("kind", "state") != "state":
            raise CheckpointError(f"{directory} holds model weights written by save_model, not a training state; "
                                  f"load it with load_checkpoint_in_model or pass a save_state directory")
        self._check_counts(manifest, directory)
        missing = sorted(name for name in manifest["files"] if not (directory / name).is_file())
        if missing:
            raise CheckpointError(f"{directory} is incomplete: {', '.join(missing[:5])} "
                                  f"{'is' if len(missing) == 1 else 'are'} missing")
        return manifest

    def _read_verified(self, directory: Path, manifest: dict) -> Any:
        """The strategy's read-ahead, run beside this rank's share of the checksum verification.

        Nothing is restored before every rank has agreed that its share is intact.
        """
        from concurrent.futures import ThreadPoolExecutor

        run, prepared = self.run, self.prepared
        files = manifest["files"]
        share = sorted(files)[run.process_index::run.num_processes] if run.config.checkpoint.verify else []
        with ThreadPoolExecutor(max_workers=1) as pool:
            verification = pool.submit(ckfiles.verify_files, directory, files, share)
            try:
                read = run.strategy.read_checkpoint(directory, prepared.models, prepared.optimizers, run.checkpoint_io,
                                                    owners=self._owners())
                read_error = None
            except Exception as exc:
                read, read_error = None, exc
            problems = verification.result()
        if problems:  # named before any error the damage caused while reading
            raise CheckpointError(f"{directory} is damaged: {'; '.join(problems[:5])}; nothing was loaded "
                                  f"(set checkpoint.verify: false only to skip this check on trusted storage)")
        if read_error is not None:
            raise read_error
        return read

    def _restore_local(self, directory: Path, manifest: dict) -> None:
        run, prepared = self.run, self.prepared
        for i, scheduler in enumerate(prepared.schedulers):
            self.restore_part(f"scheduler {i}", scheduler.load_state_dict,
                              self._load(directory / f"scheduler_{i}.pt", f"scheduler {i}"))
        for i, obj in enumerate(prepared.custom_objects):
            self.restore_part(f"registered object {i}", obj.load_state_dict,
                              self._load(directory / f"custom_checkpoint_{i}.pt", f"registered object {i}"))
        self.restore_part("precision", run.precision.load_state_dict,
                          self._load(directory / "precision.pt", "precision"))
        self.training.load_state_dict(self._load(directory / "training_state.pt", "training state"))
        rank = run.process_index
        saved_world = int(manifest.get("world_size", 1))
        rng_file = self._rank_file(directory, "rng_state_{}.pt", saved_world, "RNG state")
        if not rng_file.exists():
            raise CheckpointError(f"RNG state of rank {rank} is missing from {directory} ({rng_file.name})")
        restore_rng_state(self._load(rng_file, f"RNG state of rank {rank}"), run.device_backend)
        precision_file = self._rank_file(directory, "precision_rank_{}.pt", saved_world, "precision state")
        self.restore_part("precision (this rank's state)", run.precision.load_rank_state_dict,
                          self._load(precision_file, "precision") if precision_file.exists() else None)
        extra_file = directory / f"plugin_state_{rank}.pt"
        if run.pm.hook.torchbay_load_state_extra.get_hookimpls():
            extras = self._load(extra_file, "plugin state") if extra_file.exists() else {}
            run.pm.hook.torchbay_load_state_extra(context=run.context, state=extras)

    def _rank_file(self, directory: Path, pattern: str, saved_world: int, what: str) -> Path:
        """This rank's file; with more processes than saved the checkpoint, a saved rank's (with a warning)."""
        rank = self.run.process_index
        path = directory / pattern.format(rank)
        fallback = directory / pattern.format(rank % saved_world)
        if not path.exists() and rank >= saved_world and fallback.exists():
            # the strategy has restored (or refused) the weights; this rank repeats a saved rank's stream
            path = fallback
            log.warning("rank %d: the checkpoint was written by %d process(es); this rank resumes with the %s of "
                        "rank %d", rank, saved_world, what, rank % saved_world)
        return path

    def _check_counts(self, manifest: dict, directory: Path) -> None:
        ours = self.prepared.counts()
        theirs = manifest.get("counts") or {}
        wrong = [f"{k}: checkpoint has {theirs.get(k)}, this run prepared {v}" for k, v in ours.items()
                 if theirs.get(k) != v]
        if wrong:
            raise CheckpointError(f"{directory} does not match what was prepared ({'; '.join(wrong)}); "
                                  f"prepare and register the same objects in the same order as the run that saved it")

    @staticmethod
    def restore_part(what: str, load, state) -> None:
        """``load(state)``; any error but a ``CheckpointError`` becomes one that names ``what``."""
        try:
            load(state)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{what} could not be restored: {type(exc).__name__}: {exc}") from exc
