"""The default checkpoint of :class:`~torchbay.plugin.Strategy`: full (unsharded) state, the model through the
selected :class:`~torchbay.plugin.CheckpointIO`, each optimizer with ``torch.save``; read ahead and verified before
anything changes, then restored straight into the prepared tensors (:mod:`torchbay.storage.inplace`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from torchbay.errors import CheckpointError
from torchbay.storage.files import record_now, torch_save_recorded
from torchbay.storage.inplace import plan_optimizer, run_reads
from torchbay.storage.safe_load import safe_torch_load

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.checkpoint_io import CheckpointIO


class FullStateCheckpoint:
    """Mixed into the Strategy base (a role, with no state of its own): its defaults call the strategy's own, possibly
    overridden, methods (``model_state_dict``, ``unwrap_model``, ``load_checkpoint``), so it stays a base class."""

    # what it reads of the strategy
    name: ClassVar[str]
    rank: int
    unwrap_model: Callable[[Any], torch.nn.Module]

    def model_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict; only the main process needs a real one."""
        return self.unwrap_model(model).state_dict()

    def save_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO, *,
                        owners: list[int | None] | None = None) -> list[str]:
        """Write model and optimizer state into ``directory``; return the files this rank wrote.

        ``owners[j]`` is the index in ``models`` of the model whose parameters optimizer ``j``
        updates (``None``: several or none), as :func:`optimizer_owners` computes it.

        The default writes full state: ``model_{i}`` via ``io`` (from every rank when the io
        is collective, else from the main process) and ``optimizer_{i}.pt`` with ``torch.save``.
        """
        from concurrent.futures import ThreadPoolExecutor

        written: list[str] = []
        model_states = [self.model_state_dict(m) for m in models]
        # optimizer files are written beside the weights; each file is fsync'ed and hashed for the
        # manifest by the thread that wrote it, as soon as it is written
        with ThreadPoolExecutor(max_workers=1) as pool:
            optimizer_files = pool.submit(self._save_optimizers, directory, optimizers if self.rank == 0 else [])
            if io.collective or self.rank == 0:
                for i, state in enumerate(model_states):
                    written += record_now(directory, io.save_state_dict(state, directory, f"model_{i}"))
            return written + optimizer_files.result()

    def can_start_checkpoint(self) -> bool:
        """Whether :meth:`start_checkpoint` is offered (for a strategy whose own checkpoint is collective)."""
        return False

    def synchronous_checkpoint_reason(self) -> str:
        """Why ``save_state(blocking=False)`` saves synchronously with this strategy (neither
        ``async_checkpoint`` nor :meth:`can_start_checkpoint`): the once-logged warning's words;
        say what is missing and how to get an asynchronous save, if there is a way."""
        return f"the {self.name} strategy writes its checkpoint itself"

    def start_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO, *,
                         owners: list[int | None] | None = None) -> Callable[[], list[str]]:
        """An asynchronous save's model and optimizer part, for a strategy that writes them itself
        (``can_start_checkpoint()``): take the state at the call and start writing it into
        ``directory``; return a function that waits for those writes and returns the files this
        rank wrote. Both run on the main thread of every rank, in the same order (the function at
        the point where the ranks agree on the save); collectives the writes need run on a
        process group of their own, never on the training loop's. No rank may start a write
        unless every rank can: take the state first, agree (``all_gather_object``), then start;
        a rank that could not take it raises, the others start nothing and return.
        """
        raise NotImplementedError

    def release_checkpoint_staging(self) -> None:
        """Drop the host memory :meth:`start_checkpoint` keeps from one save to the next, if any (at
        ``end_training``, once no save is in flight)."""

    @staticmethod
    def _save_optimizers(directory: Path, optimizers: list) -> list[str]:
        for i, opt in enumerate(optimizers):
            torch_save_recorded(opt.state_dict(), directory / f"optimizer_{i}.pt")
        return [f"optimizer_{i}.pt" for i in range(len(optimizers))]

    def read_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO, *,
                        owners: list[int | None] | None = None) -> Any:
        """Read what :meth:`load_checkpoint` restores, changing no object; ``None`` reads nothing ahead.

        torchbay runs it beside the checkpoint's checksum verification and passes the result
        to ``load_checkpoint(..., read=...)`` once every rank has verified its files. The
        default reads only the structure: the safetensors headers checked against each model
        (``io.in_place_reads``) and each optimizer's state dict with its tensors left on disk
        (:func:`torchbay.storage.inplace.plan_optimizer`); ``load_checkpoint`` then reads every
        tensor straight into the prepared objects, so the state is never held twice in memory.
        """
        if type(self).load_checkpoint is not FullStateCheckpoint.load_checkpoint:
            return None  # a strategy with its own load_checkpoint reads for itself
        models_ahead = [None if io.collective else
                        io.in_place_reads(directory, f"model_{i}", self.unwrap_model(m).state_dict())
                        for i, m in enumerate(models)]
        optimizers_ahead = [plan_optimizer(opt, directory / f"optimizer_{i}.pt", f"optimizer {i}", trusted=io.trusted)
                            for i, opt in enumerate(optimizers)]
        return _ReadAhead(models_ahead, optimizers_ahead)

    def load_checkpoint(self, directory: Path, models: list, optimizers: list, io: CheckpointIO,
                        read: Any = None, *, owners: list[int | None] | None = None) -> None:
        """Restore models and optimizers from ``directory`` (``read``: what :meth:`read_checkpoint` returned).

        Each model's tensors are read into its own tensors (``io.in_place_reads``, or
        ``io.load_state_dict`` with the model's state as ``template``), each optimizer's state
        into its existing state tensors, one optimizer at a time; where that does not apply,
        the state is read whole and loaded with ``load_state_dict``.
        """
        ahead = read if isinstance(read, _ReadAhead) else _ReadAhead([None] * len(models), [None] * len(optimizers))
        for i, model in enumerate(models):
            module = self.unwrap_model(model)
            reads, ahead.models[i] = ahead.models[i], None
            template = module.state_dict()
            if reads is not None:
                run_reads(reads)  # the template's tensors are the model's: loading them below changes nothing more
                state = template
            else:
                state = io.load_state_dict(directory, f"model_{i}", device="cpu", template=template)
            try:
                missing, unexpected = module.load_state_dict(state, strict=False)
            except Exception as exc:
                raise CheckpointError(f"model {i} in {directory} does not fit the prepared model: {exc}") from exc
            del state, template
            missing = [k for k in missing if not k.endswith("_extra_state")]  # non-tensor state is not in the file
            if missing or unexpected:
                raise CheckpointError(f"model {i} in {directory} does not fit the prepared model: missing keys "
                                      f"{missing[:10]}, unexpected keys {unexpected[:10]}")
        for i, opt in enumerate(optimizers):
            path = directory / f"optimizer_{i}.pt"
            plan, ahead.optimizers[i] = ahead.optimizers[i], None
            try:
                if plan is None:
                    plan = plan_optimizer(opt, path, f"optimizer {i}", trusted=io.trusted)
                if plan is not None:
                    plan.apply()
                else:
                    opt.load_state_dict(safe_torch_load(path, f"optimizer {i}", trusted=io.trusted))
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"optimizer {i} could not be restored from {directory}: {exc}") from exc
            del plan



class _ReadAhead:
    """What the default ``read_checkpoint`` read: per model the planned reads (or ``None``), per
    optimizer its :class:`~torchbay.storage.inplace.OptimizerPlan` (or ``None``)."""

    def __init__(self, models: list, optimizers: list):
        self.models, self.optimizers = models, optimizers
