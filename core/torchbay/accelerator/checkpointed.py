"""What ``save_state`` saves, as the Accelerator holds it: the prepared objects (``prepared_objects``, a
:class:`~torchbay.checkpoint.inputs.PreparedObjects`) and the run's counters (``training_state``, a
:class:`~torchbay.checkpoint.inputs.TrainingState`), built once together with the checkpointer they are given to.

Accelerate's names for them stay: ``_models``, ``_optimizers``, ``_schedulers``, ``_dataloaders`` and
``_custom_objects`` (read and appended to by code written for Accelerate, transformers' Trainer among it) are the
very lists of ``prepared_objects``; ``save_iteration`` and ``tracker_step`` read and set ``training_state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchbay.checkpoint.inputs import CheckpointServices, PreparedObjects, TrainingState

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.checkpoint_io import CheckpointIO
    from torchbay.axes.context import RunContext
    from torchbay.config.model import CoreConfig
    from torchbay.data.gradient_state import GradientState


def _prepared_list(kind: str) -> property:
    """Accelerate's ``_<kind>`` attribute: ``prepared_objects.<kind>``, the same list object."""

    def get(self) -> list[Any]:
        return getattr(self.prepared_objects, kind)

    def set_(self, value: list[Any]) -> None:  # ``acc._models += [...]`` assigns the list it extended
        setattr(self.prepared_objects, kind, value)

    return property(get, set_, doc=f"Accelerate's ``_{kind}``: ``prepared_objects.{kind}`` (the same list).")


def _training_counter(name: str, doc: str) -> property:
    """A counter of ``training_state`` read and set under the same name on the Accelerator."""

    def get(self) -> int:
        return getattr(self.training_state, name)

    def set_(self, value: int) -> None:
        setattr(self.training_state, name, value)

    return property(get, set_, doc=doc)


class CheckpointedState:
    """Mixin of :class:`~torchbay.accelerator.accelerator.Accelerator`: owns the prepared objects and the training
    state, and gives them (with the run's selected objects, never the Accelerator) to its checkpointer."""

    # what it reads from the Accelerator (made before ``_setup_checkpointing`` runs)
    context: RunContext
    config: CoreConfig
    checkpoint_io: CheckpointIO
    gradient_state: GradientState

    _models = _prepared_list("models")
    _optimizers = _prepared_list("optimizers")
    _schedulers = _prepared_list("schedulers")
    _dataloaders = _prepared_list("dataloaders")
    _custom_objects = _prepared_list("custom_objects")
    save_iteration = _training_counter("save_iteration", "The number of the next automatic checkpoint "
                                                         "(``checkpoint_<n>``).")
    tracker_step = _training_counter("tracker_step", "The step ``log`` uses when it is given none (saved with the "
                                                     "training state).")

    def _setup_checkpointing(self) -> None:
        """Once the context, the checkpoint io and the gradient state exist."""
        self.prepared_objects = PreparedObjects()
        self.training_state = TrainingState(self.gradient_state, self.prepared_objects,
                                            save_iteration=self.config.project.iteration)
        self._built_checkpointer = None

    @property
    def _checkpointer(self):
        """The :class:`~torchbay.checkpoint.checkpointer.StateCheckpointer`, built (and its modules imported) at
        the first save or load: a run that never checkpoints does not pay for them at start-up."""
        if self._built_checkpointer is None:
            from torchbay.checkpoint.checkpointer import StateCheckpointer

            self._built_checkpointer = StateCheckpointer(CheckpointServices(self.context, self.checkpoint_io),
                                                         self.prepared_objects, self.training_state)
        return self._built_checkpointer

    def _finish_checkpoints(self) -> None:
        """The checkpointer's end (a save in flight, staging memory, removals); nothing to do before the first save."""
        if self._built_checkpointer is not None:
            self._built_checkpointer.end()
