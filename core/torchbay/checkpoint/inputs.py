"""What the :class:`~torchbay.checkpoint.checkpointer.StateCheckpointer` is given, and all it is given: the prepared
objects (:class:`PreparedObjects`), the run's counters (:class:`TrainingState`) and the run's selected objects
(:class:`CheckpointServices`). The Accelerator owns the first two and builds the third; the checkpointer never
sees the Accelerator (``tests/architecture/test_checkpoint_inputs.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.checkpoint_io import CheckpointIO
    from torchbay.axes.context import RunContext
    from torchbay.axes.device import DeviceBackend
    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import Strategy
    from torchbay.config.model import CoreConfig
    from torchbay.data.gradient_state import GradientState
    from torchbay.registry.manager import PluginManager


@dataclass(eq=False)
class PreparedObjects:
    """Everything ``prepare`` returned and ``register_for_checkpointing`` was given, each kind in call order (the
    order a checkpoint stores them in). The Accelerator's ``_models``, ``_optimizers``, ``_schedulers``,
    ``_dataloaders`` and ``_custom_objects`` (Accelerate's names) are these same lists."""

    models: list[Any] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: list[Any] = field(default_factory=list)
    custom_objects: list[Any] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many of each kind (a manifest's ``counts``: a checkpoint loads into the same numbers only)."""
        return {"models": len(self.models), "optimizers": len(self.optimizers), "schedulers": len(self.schedulers),
                "dataloaders": len(self.dataloaders), "custom_objects": len(self.custom_objects)}


class TrainingState:
    """The run's counters that a checkpoint carries besides the objects' own state: the gradient-accumulation step,
    the next automatic checkpoint's number (``save_iteration``), the step ``log`` uses when given none
    (``tracker_step``) and each prepared data loader's position. Saved as ``training_state.pt``; restoring it sets
    the step, the tracker step and the loaders (``save_iteration`` follows the loaded folder's name instead)."""

    def __init__(self, gradient_state: GradientState, prepared: PreparedObjects, save_iteration: int = 0):
        self.gradient_state = gradient_state
        self.prepared = prepared
        self.save_iteration = save_iteration
        self.tracker_step = 0

    @property
    def gradient_step(self) -> int:
        return self.gradient_state.step

    @gradient_step.setter
    def gradient_step(self, value: int) -> None:
        self.gradient_state.step = value

    @property
    def syncs_gradients(self) -> bool:
        """False inside a gradient-accumulation window (what has accumulated so far is not in a checkpoint)."""
        return self.gradient_state.sync_gradients

    def state_dict(self) -> dict[str, Any]:
        return {"gradient_step": self.gradient_step, "save_iteration": self.save_iteration,
                "dataloaders": [loader.state_dict() for loader in self.prepared.dataloaders],
                "tracker_step": self.tracker_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gradient_step = int(state["gradient_step"])
        self.tracker_step = int(state.get("tracker_step", self.tracker_step))
        for loader, loader_state in zip(self.prepared.dataloaders, state["dataloaders"]):
            loader.load_state_dict(loader_state)


@dataclass(frozen=True, eq=False)
class CheckpointServices:
    """The run's selected objects a checkpoint is written and read with: the :class:`RunContext` (config, plugin
    manager, device backend, strategy, precision; the context the state-extra hooks get) and the selected
    :class:`CheckpointIO`. Which process this is comes from the strategy, as the Accelerator's does."""

    context: RunContext
    checkpoint_io: CheckpointIO

    @property
    def config(self) -> CoreConfig:
        return self.context.config

    @property
    def pm(self) -> PluginManager:
        return self.context.pm

    @property
    def strategy(self) -> Strategy:
        return self.context.strategy

    @property
    def precision(self) -> Precision:
        return self.context.precision

    @property
    def device_backend(self) -> DeviceBackend:
        return self.context.device_backend

    @property
    def process_index(self) -> int:
        return self.strategy.rank

    @property
    def num_processes(self) -> int:
        return self.strategy.world_size

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0
