"""Checkpoint io (how tensors reach storage) and ``save_state`` / ``load_state``.

A state directory holds ``torchbay_manifest.json`` (versions, world size, plugins, config,
and every file with its size and checksum), the weights written by the strategy through
the selected :class:`CheckpointIO`, optimizer/scheduler/precision state, RNG state per
rank, data-loader positions, registered objects and plugin extras. How it reaches disk
(atomic publish, what may be replaced, recovery) is :mod:`torchbay.storage.publish`; how
files are read without running code is :mod:`torchbay.storage.safe_load`. Every step that can fail
on one rank is agreed on by all ranks, so a failure anywhere is an error everywhere.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchbay.axes.strategy import optimizer_owners
from torchbay.checkpoint.async_save import AsyncSave, Staged, StagingBuffer, completed
from torchbay.checkpoint.background import BackgroundSaving, StateParts, describe_error
from torchbay.checkpoint.io_choice import CheckpointIOChoice
from torchbay.checkpoint.model_folder import ModelFolder
from torchbay.checkpoint.restore import StateRestore
from torchbay.checkpoint.save_hooks import BeforeWrite, SaveHookSupport
from torchbay.distributed.rng import capture_rng_state
from torchbay.errors import CheckpointError
from torchbay.storage import files as ckfiles
from torchbay.storage import publish as ckdir
from torchbay.storage.publish import AUTOMATIC_NAME, FORMAT_VERSION
from torchbay.storage.safe_load import safe_torch_load

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.checkpoint.inputs import CheckpointServices, PreparedObjects, TrainingState

log = logging.getLogger("torchbay")


# --- save / load ---------------------------------------------------------------------------


def _torch_save(obj: Any, path: Path) -> str:
    return ckfiles.torch_save_recorded(obj, path)  # fsync'ed and hashed as it is written


def publish_model(state: dict[str, torch.Tensor], final: Path, max_shard_size: str, fields: dict[str, Any],
                  what: str, safe_serialization: bool = True) -> list[str]:
    """Write ``state`` into the folder ``final`` as Accelerate's ``save_model`` does (see
    :mod:`torchbay.checkpoint.model_folder`; ``safe_serialization=False``: torch's ``.bin`` files); the names
    written."""
    return ModelFolder(final, what).save(state, max_shard_size, fields, safe_serialization)


class StateCheckpointer(BackgroundSaving, StateRestore, CheckpointIOChoice, SaveHookSupport):
    """``save_state`` / ``load_state`` / ``save_model``'s files; one per run.

    It is given the run's selected objects (``run``), the prepared objects it saves and restores (``prepared``) and
    the run's counters (``training``), each read when a checkpoint is taken (:mod:`torchbay.checkpoint.inputs`).
    """

    def __init__(self, run: CheckpointServices, prepared: PreparedObjects, training: TrainingState):
        self.run = run
        self.prepared = prepared
        self.training = training
        self._announced_continuation = False
        self._pending: AsyncSave | None = None  # the asynchronous save in flight
        self._stage: StagingBuffer | None = None  # reused by every asynchronous save
        self._warned_sync: set[str] = set()

    @property
    def trusted(self) -> bool:
        return bool(self.run.config.checkpoint.allow_unsafe_pickle)

    def _load(self, path: Path, what: str) -> Any:
        return safe_torch_load(path, what, trusted=self.trusted)

    # -- agreement between ranks ---------------------------------------------------------
    def on_every_rank(self, what: str, fn: Callable[[], Any], cleanup: Callable[[], None] | None = None,
                      share: bool = False) -> Any:
        """Run ``fn`` on every rank; if it failed anywhere, raise the same error everywhere.

        Returns this rank's result, or every rank's results when ``share``. ``cleanup`` runs
        (on every rank) before the error is raised.
        """
        error: BaseException | None = None
        result = None
        try:
            result = fn()
        except Exception as exc:
            error = exc
        message = describe_error(error) if error else None
        gathered = self.run.strategy.all_gather_object((result if share else None, message))
        failed = [(rank, message) for rank, (_, message) in enumerate(gathered) if message]
        if failed:
            if cleanup is not None:
                cleanup()
            if len(gathered) == 1 and isinstance(error, CheckpointError):
                raise error
            messages = sorted({m for _, m in failed})
            where = "" if len(gathered) == 1 else f" on rank {', '.join(str(r) for r, _ in failed)}"
            raise CheckpointError(f"{what} failed{where}: {' | '.join(messages)}") from error
        return [r for r, _ in gathered] if share else result

    def main_only(self, what: str, fn: Callable[[], Any], cleanup: Callable[[], None] | None = None) -> Any:
        """``fn`` on the main process; its result (or its error) reaches every rank."""
        results = self.on_every_rank(what, lambda: fn() if self.run.is_main_process else None, cleanup, share=True)
        return results[0]

    # -- where -----------------------------------------------------------------------
    def checkpoints_root(self) -> Path:
        return Path(self.run.config.project.project_dir).absolute() / "checkpoints"

    def automatic_dirs(self) -> list[tuple[Path, dict]]:
        """This project's complete automatic checkpoints with their manifests, oldest first."""
        root = self.checkpoints_root()
        found = []
        for path in root.glob("checkpoint_*"):
            if not AUTOMATIC_NAME.fullmatch(path.name):
                continue
            try:
                manifest = ckdir.read_manifest(path)
            except CheckpointError:
                continue
            if manifest.get("kind") == "state" and manifest.get("project") == str(root.parent):
                found.append((path, manifest))
        return sorted(found, key=lambda pm: (pm[1].get("created", 0), int(pm[0].name.split("_")[1])))

    def _next_automatic(self) -> Path:
        """checkpoint_<n>: never a number that exists already (a new run continues after the highest)."""
        root = self.checkpoints_root()
        taken = [int(m.group(1)) for p in (root.iterdir() if root.is_dir() else ())
                 if (m := AUTOMATIC_NAME.fullmatch(p.name.split(".")[0]))]
        if taken and self.training.save_iteration <= max(taken):
            if not self._announced_continuation:
                log.warning("torchbay: %s already holds checkpoints up to checkpoint_%d; this run saves from "
                            "checkpoint_%d on (existing checkpoints are never overwritten)", root, max(taken),
                            max(taken) + 1)
                self._announced_continuation = True
            self.training.save_iteration = max(taken) + 1
        return root / f"checkpoint_{self.training.save_iteration}"

    def target_for_save(self, output_dir: str | None) -> Path:
        project = self.run.config.project
        if project.automatic_checkpoint_naming:
            if output_dir is not None:
                raise CheckpointError("project.automatic_checkpoint_naming is on: call save_state() without a "
                                      "directory, or turn automatic naming off")
            return self._next_automatic()
        if output_dir is None:
            raise CheckpointError("save_state() needs a directory, or set project.automatic_checkpoint_naming: true")
        return Path(output_dir).absolute()

    # -- save --------------------------------------------------------------------------
    def save(self, output_dir: str | None = None, blocking: bool | None = None,
             before_write: BeforeWrite | None = None) -> Path | AsyncSave:
        """Save the state; with ``blocking=False`` (or ``checkpoint.async_save`` for automatic
        checkpoints) copy it now and write it in the background (:mod:`torchbay.checkpoint.async_save`).

        A save still in flight is finished first: never two writers, and the staging buffer is free.
        ``before_write`` (save-state pre-hooks, :mod:`torchbay.checkpoint.save_hooks`) or an io chosen for this save
        (``using_io``) makes it write at once.
        """
        run = self.run
        self.finish_pending()
        if blocking is None:
            blocking = not (run.config.checkpoint.async_save and run.config.project.automatic_checkpoint_naming
                            and output_dir is None)
        if not self.training.syncs_gradients:
            log.warning("save_state is called inside a gradient accumulation window: the gradients accumulated so "
                        "far are not saved; save after a step where accelerator.sync_gradients is True")
        background = (not blocking and before_write is None and not self.io_overridden
                      and self._can_save_in_background())

        def open_target() -> Path:
            final = self.target_for_save(output_dir)
            ckdir.check_replaceable(final, "save_state")
            ckdir.recover_interrupted_save(final)
            ckdir.begin_partial(final)
            return final

        final = self.main_only("save_state", open_target)
        partial, _ = ckdir.siblings(final)

        def discard() -> None:
            if run.is_main_process:
                ckdir.discard_partial(partial)

        if background:
            return self._save_in_background(final, partial, discard)
        added, kept = self.run_before_write(partial, before_write, discard) if before_write else ([], None)

        def write() -> dict:
            hooks_wrote = ckfiles.record_files(partial, added) if run.is_main_process else {}
            return {**hooks_wrote, **self._write_recorded(partial, self._capture(None))}

        with self.only_models(kept):
            records_per_rank = self.on_every_rank("save_state", write, cleanup=discard, share=True)
            self.main_only("save_state", lambda: self._publish(final, partial, records_per_rank, None),
                            cleanup=discard)
        self._after_publish(final)
        return final if blocking else completed(final)

    def _write_recorded(self, partial: Path, parts: StateParts) -> dict:
        return ckfiles.record_files(partial, self._write_parts(partial, parts))

    def _publish(self, final: Path, partial: Path, records_per_rank: list[dict], manifest: dict | None) -> None:
        """Main process: the manifest (``manifest``: the fields taken at the call), the rename, rotation."""
        records = {name: rec for recs in records_per_rank for name, rec in recs.items()}
        manifest = self._manifest("state", records) if manifest is None else {**manifest, "files": records}
        ckdir.write_manifest(partial, manifest)
        ckdir.publish(partial, final)
        self._rotate()

    def _after_publish(self, final: Path) -> None:
        if self.run.config.project.automatic_checkpoint_naming and AUTOMATIC_NAME.fullmatch(final.name):
            self.training.save_iteration = int(final.name.split("_")[1]) + 1

    def _capture(self, stage: StagingBuffer | None, without_models: bool = False) -> StateParts:
        """What a checkpoint holds: the live objects (``stage`` is ``None``: written now) or a copy of
        their state in ``stage`` (written later by the background thread)."""
        run, prepared = self.run, self.prepared
        copy = (lambda obj, _: obj) if stage is None else stage.copy
        main = run.is_main_process
        owners = self._owners()
        if stage is None:
            models, optimizers = prepared.models, prepared.optimizers
        elif without_models:  # written by the strategy's start_checkpoint
            models, optimizers = [], []
        else:
            writes_models = run.checkpoint_io.collective or run.process_index == 0  # as Strategy.save_checkpoint
            models = [Staged(copy(run.strategy.model_state_dict(m), f"model_{i}") if writes_models else {})
                      for i, m in enumerate(prepared.models)]
            optimizers = [Staged(copy(o.state_dict(), f"optimizer_{i}")) if run.process_index == 0 else o
                          for i, o in enumerate(prepared.optimizers)]
        extras: dict = {}
        for extra in run.pm.hook.torchbay_state_extra(context=run.context):
            clash = set(extras) & set(extra or {})
            if clash:
                raise CheckpointError(f"two plugins save the same extra state key(s) {sorted(clash)}")
            extras.update(extra or {})
        return StateParts(
            models=models, optimizers=optimizers, owners=owners,
            rng=copy(capture_rng_state(run.device_backend), "rng"),
            rank_precision=copy(run.precision.rank_state_dict(), "precision_rank"),
            schedulers=[copy(s.state_dict(), f"scheduler_{i}") for i, s in enumerate(prepared.schedulers)]
            if main else [],
            custom=[copy(o.state_dict(), f"custom_{i}") for i, o in enumerate(prepared.custom_objects)] if main else [],
            precision=copy(run.precision.state_dict(), "precision") if main else None,
            training_state=copy(self.training.state_dict(), "training_state") if main else None,
            extras=copy(extras, "extras"),
            manifest=self._manifest("state", {}) if stage is not None and main else None,
            started=without_models,
        )

    def _owners(self) -> list[int | None]:
        """Which prepared model each prepared optimizer updates (see ``Strategy.save_checkpoint``)."""
        return optimizer_owners(self.prepared.models, self.prepared.optimizers)

    def _write_parts(self, directory: Path, parts: StateParts) -> list[str]:
        run = self.run
        rank = run.process_index
        files = [] if parts.started else run.strategy.save_checkpoint(directory, parts.models, parts.optimizers,
                                                                      run.checkpoint_io, owners=parts.owners)
        files.append(_torch_save(parts.rng, directory / f"rng_state_{rank}.pt"))
        if parts.rank_precision is not None:
            files.append(_torch_save(parts.rank_precision, directory / f"precision_rank_{rank}.pt"))
        if run.is_main_process:
            for i, state in enumerate(parts.schedulers):
                files.append(_torch_save(state, directory / f"scheduler_{i}.pt"))
            for i, state in enumerate(parts.custom):
                files.append(_torch_save(state, directory / f"custom_checkpoint_{i}.pt"))
            files.append(_torch_save(parts.precision, directory / "precision.pt"))
            files.append(_torch_save(parts.training_state, directory / "training_state.pt"))
        if parts.extras:
            files.append(_torch_save(parts.extras, directory / f"plugin_state_{rank}.pt"))
        return files

    def _manifest(self, kind: str, files: dict[str, dict]) -> dict[str, Any]:
        run = self.run
        return {
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "created": time.time(),
            "project": str(self.checkpoints_root().parent),
            "step": self.training.gradient_step,
            "torchbay_version": run.pm.infos.get("cpu").version if run.pm.infos.get("cpu") else "?",
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "world_size": run.num_processes,
            "device": run.device_backend.name,
            "strategy": run.strategy.name,
            "checkpoint_io": run.checkpoint_io.name,
            "precision": run.precision.describe(),
            "plugins": {n: f"{i.distribution} {i.version}" for n, i in run.pm.infos.items()
                        if i.status in ("loaded", "builtin")},
            "counts": self.prepared.counts(),
            "config": run.config.model_dump(mode="json"),
            "files": files,
        }

    def _rotate(self) -> None:
        """Keep the newest ``project.total_limit`` automatic checkpoints of this project."""
        project = self.run.config.project
        if not (project.automatic_checkpoint_naming and project.total_limit):
            return
        dirs = self.automatic_dirs()
        for stale, _ in dirs[:-project.total_limit]:  # ordered by creation time: the newest is always kept
            try:
                ckdir.remove_own_checkpoint(stale, f"project.total_limit is {project.total_limit}")
                log.warning("torchbay: removed the old checkpoint %s (project.total_limit: %d)", stale,
                            project.total_limit)
            except (CheckpointError, OSError) as exc:
                log.warning("torchbay: kept %s: %s", stale, exc)

    # -- save_model ----------------------------------------------------------------------
    def save_model_files(self, state: dict[str, torch.Tensor], save_directory: str, max_shard_size: str,
                         safe_serialization: bool = True) -> list[str]:
        """Write full weights as Accelerate's save_model does (main process); no manifest beside them."""
        fields = {k: v for k, v in self._manifest("model", {}).items() if k not in ("config", "counts", "files")}
        return self.main_only("save_model", lambda: publish_model(state, Path(save_directory), max_shard_size,
                                                                    fields, "save_model", safe_serialization)) or []

