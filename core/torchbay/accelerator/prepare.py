"""The ``Accelerator``'s ``prepare`` family, with Accelerate's names.

A mixin of :class:`~torchbay.accelerator.accelerator.Accelerator`. One ``prepare`` call runs, in order:
the precision's ``convert_module`` on each model, the strategy's ``connect_dataloader`` on
each data loader, the precision's ``prepare`` (engines that must see models and optimizers
together), the strategy's ``setup`` (moving and wrapping), then torchbay's own wrappers
(the forward under the precision's autocast, ``PreparedOptimizer``, ``PreparedScheduler``,
the sharded data loaders), and last the ``compile`` step (``torch.compile`` of the modules the
strategy names, in place; see :mod:`torchbay.compile.compiler`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from torchbay.accelerator.prepared import PreparedOptimizer, PreparedScheduler
from torchbay.compile.compiler import ModelCompiler, bind_forward
from torchbay.data import operations
from torchbay.data.loader import PreparedDataLoader, SkipFirstBatches
from torchbay.data.prepare import prepare_data_loader
from torchbay.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.device import DeviceBackend
    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import Strategy
    from torchbay.config.model import CoreConfig
    from torchbay.data.gradient_state import GradientState
    from torchbay.process.state import AcceleratorState


class Preparation:
    """Methods of the Accelerator that turn the user's objects into prepared ones."""

    # what preparing reads from the Accelerator: its selected objects and settings
    config: CoreConfig
    state: AcceleratorState
    device: torch.device
    device_backend: DeviceBackend
    strategy: Strategy
    precision: Precision
    gradient_state: GradientState
    # ... and the prepared objects it adds to (Accelerate's names for prepared_objects' lists, checkpointed.py)
    _models: list[Any]
    telemetry: Any
    _optimizers: list[PreparedOptimizer]
    _schedulers: list[PreparedScheduler]
    _dataloaders: list[Any]

    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and data loaders (any order, any number of calls).

        ``device_placement``: one flag per object (default: the ``device_placement`` setting);
        a data loader with ``False`` yields batches where they are.
        """
        self.state.distributed_type  # noqa: B018 (raises StateResetError after AcceleratorState._reset_state())
        placements = self._placements(objects, device_placement)
        objects = [self.precision.convert_module(o) if isinstance(o, torch.nn.Module) and not _prepared(o) else o
                   for o in objects]
        kinds = [self._kind(o) for o in objects]
        for obj, kind, placed in zip(objects, kinds, placements):
            if kind == "model":
                _refuse_offloaded_quantized(obj)
            if kind == "model" and not placed:
                self._check_unplaced_model(obj)
            if kind == "dataloader":
                self.strategy.connect_dataloader(obj)
        models = [o for o, k in zip(objects, kinds) if k == "model"]
        optimizers = [o for o, k in zip(objects, kinds) if k == "optimizer"]
        schedulers = [o for o, k in zip(objects, kinds) if k == "scheduler"]
        models, optimizers = self.precision.prepare(models, optimizers)
        models, optimizers, schedulers = self.strategy.setup(models, optimizers, schedulers)
        models = [self._compiler.compile(self._wrap_forward(m)) for m in models]
        prepared_opts = [PreparedOptimizer(o, self) for o in optimizers]
        self._models += models
        self._optimizers += prepared_opts
        queues = {"model": iter(models), "optimizer": iter(prepared_opts), "scheduler": iter(schedulers)}
        result = []
        for obj, kind, placed in zip(objects, kinds, placements):
            if kind in queues:
                obj = next(queues[kind])
                if kind == "scheduler":
                    if isinstance(obj, PreparedScheduler):  # the strategy's own prepared form (it steps it itself)
                        obj.accelerator, obj.optimizers = self, self._optimizers_for(obj)
                    else:
                        obj = PreparedScheduler(obj, self._optimizers_for(obj), self)
                    self._schedulers.append(obj)
            elif kind == "dataloader":
                obj = self.prepare_data_loader(obj, device_placement=placed)
            elif kind == "prepared":
                self._keep_prepared(obj)
            if kind != "other":
                _mark_prepared(obj)
            result.append(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def _keep_prepared(self, obj: Any) -> None:
        """An object prepared before comes back unchanged; this accelerator tracks it (as Accelerate does)."""
        bucket = (self._optimizers if isinstance(obj, PreparedOptimizer) else
                  self._schedulers if isinstance(obj, PreparedScheduler) else
                  self._dataloaders if isinstance(obj, DataLoader) else self._models)
        if not any(item is obj for item in bucket):
            bucket.append(obj)

    @property
    def _compiler(self) -> ModelCompiler:
        """The ``compile`` step (made on first use: it needs the selected strategy and precision)."""
        compiler = self.__dict__.get("_model_compiler")
        if compiler is None:
            compiler = self._model_compiler = ModelCompiler(self.config.compile, self.strategy, self.precision)
        return compiler

    def _placements(self, objects: tuple, device_placement: list[bool] | None) -> list[bool]:
        if device_placement is None:
            return [self.config.device_placement] * len(objects)
        if len(device_placement) != len(objects):
            raise ConfigError(f"prepare(device_placement=...) has {len(device_placement)} flag(s) for "
                              f"{len(objects)} object(s); give one flag per object")
        return list(device_placement)

    def _check_unplaced_model(self, model: torch.nn.Module) -> None:
        """A model to train is placed by the strategy; leaving it elsewhere is only possible where it already is."""
        here = (self.device.type, self.device.index or 0)
        off_device = {str(p.device) for p in model.parameters() if (p.device.type, p.device.index or 0) != here}
        if off_device:
            raise ConfigError(f"device_placement=False for a model to train, whose parameters are on "
                              f"{', '.join(sorted(off_device))} and not on {self.device}: torchbay's strategy "
                              f"places training models on the process's device. Move the model yourself, or "
                              f"prepare it with prepare_model(model, evaluation_mode=True) for inference")

    @staticmethod
    def _kind(obj: Any) -> str:
        if _prepared(obj):
            return "prepared"
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, PreparedOptimizer):
            return "optimizer"
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or hasattr(obj, "step") and hasattr(obj, "optimizer"):
            return "scheduler"
        if isinstance(obj, DataLoader):
            return "dataloader"
        return "other"

    def _optimizers_for(self, scheduler: Any) -> list[PreparedOptimizer]:
        target = getattr(scheduler, "optimizer", None)
        return [o for o in self._optimizers if o.optimizer is target or o is target] or list(self._optimizers)

    def _wrap_forward(self, model: Any) -> Any:
        """Run the forward in the precision's context; half-precision outputs come back as fp32
        (as Accelerate's ``convert_outputs_to_fp32``), so a loss computed outside the model runs
        in fp32, as it would inside a raw ``torch.autocast`` block."""
        inner = self.strategy.unwrap_model(model)
        if self.precision.wraps_forward and not hasattr(inner, "_torchbay_original_forward"):
            original = inner.forward
            precision = self.precision

            @functools.wraps(original)  # its name and doc; bind_forward gives its signature
            def forward(module, *args, **kwargs):
                with precision.forward_context():
                    return module._torchbay_original_forward(*args, **kwargs)

            inner._torchbay_original_forward = original
            wrapped = operations.convert_outputs_to_fp32(forward) if precision.fp32_outputs else forward
            inner.forward = bind_forward(inner, wrapped, like=original)
        return model

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """Prepare one model; ``evaluation_mode=True`` only places it and applies the precision (no
        strategy wrapping, as Accelerate does for inference)."""
        if evaluation_mode:
            self.state.distributed_type  # noqa: B018 (raises StateResetError after _reset_state())
            model = self.precision.convert_module(model)
            if self.config.device_placement if device_placement is None else device_placement:
                model = model.to(self.device)
            return self._compiler.compile(self._wrap_forward(model))
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> PreparedOptimizer:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        return self.prepare(scheduler)

    def prepare_data_loader(self, dataloader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> PreparedDataLoader:
        """This process's share of ``dataloader`` (see torchbay.data.prepare: Accelerate's order at the same seed)."""
        if _prepared(dataloader):
            self._keep_prepared(dataloader)
            return dataloader
        self.strategy.connect_dataloader(dataloader)
        cfg = self.config.dataloader
        placement = self.config.device_placement if device_placement is None else device_placement
        # ranks of one tensor/context parallel group read the same batch: split by the data-parallel rank
        loader = prepare_data_loader(dataloader, self.device, num_processes=self.strategy.data_parallel_size,
                                     process_index=self.strategy.data_parallel_rank,
                                     split_batches=cfg.split_batches, put_on_device=placement,
                                     rng_types=list(getattr(self, "rng_types", None) or ["generator"]),
                                     dispatch_batches=cfg.dispatch_batches, even_batches=cfg.even_batches,
                                     slice_fn_for_dispatch=slice_fn_for_dispatch,
                                     use_seedable_sampler=cfg.use_seedable_sampler, data_seed=cfg.data_seed,
                                     non_blocking=cfg.non_blocking,
                                     use_stateful_dataloader=cfg.use_stateful_dataloader)
        loader.gradient_state, loader._strategy = self.gradient_state, self.strategy
        loader._batches = self.strategy.wrap_batches(self.device_backend.wrap_dataloader(loader.base_dataloader))
        if self.telemetry is not None:  # data-wait time, samples and tokens of every batch
            loader._batch_watch = self.telemetry.watch
        self._dataloaders.append(loader)
        _mark_prepared(loader)
        return loader


def _refuse_offloaded_quantized(model: Any) -> None:
    """A model loaded in 8 or 4 bits (bitsandbytes) whose ``hf_device_map`` puts part of it on the cpu or disk
    cannot be trained: its offloaded weights would never be updated."""
    if not (getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)):
        return
    offloaded = sorted(name for name, where in (getattr(model, "hf_device_map", None) or {}).items()
                       if str(where) in ("cpu", "disk"))
    if offloaded:
        raise ConfigError(f"prepare: this model was loaded in 8-bit or 4-bit precision with CPU or disk offload "
                          f"({', '.join(repr(n) for n in offloaded)} in its hf_device_map), which cannot be "
                          f"trained; load it with a device_map that keeps every module on the accelerator, or "
                          f"prepare it with prepare_model(model, evaluation_mode=True) for inference")


def _prepared(obj: Any) -> bool:
    """Whether ``obj`` came out of a ``prepare`` (which then gives it back unchanged)."""
    return isinstance(obj, (PreparedOptimizer, PreparedScheduler, PreparedDataLoader, SkipFirstBatches)) or \
        bool(getattr(obj, "_is_accelerate_prepared", False))


def _mark_prepared(obj: Any) -> None:
    try:
        obj._is_accelerate_prepared = True  # Accelerate's mark, which libraries read
    except (AttributeError, TypeError):
        pass

