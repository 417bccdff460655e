"""The ``Accelerator``: the user-facing API, with Hugging Face Accelerate's names.

It resolves the config, selects a device, strategy and precision through the plugin
manager, joins the process group when there are several processes, and from then on calls
plain methods of the selected objects (no hook dispatch per step).
"""

from __future__ import annotations

import contextlib
import copyreg
import gc
from typing import Any, Iterable

import torch

from torchbay.accelerator.checkpointed import CheckpointedState
from torchbay.accelerator.handler_settings import check_handler_modes, settings_of_handlers
from torchbay.accelerator.prepare import Preparation
from torchbay.accelerator.process import ProcessControl
from torchbay.accelerator.state_io import StateSaving
from torchbay.accelerator.surface import plugin_objects
from torchbay.accelerator.surface import translate as translate_accelerate_arguments
from torchbay.accelerator.tracking import Tracking
from torchbay.axes.strategy import Strategy
from torchbay.compat.accelerator_views import AcceleratorViews
from torchbay.config.handlers import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)
from torchbay.config.model import ResolvedConfig
from torchbay.data.gradient_state import GradientState
from torchbay.data.prepare import skip_first_batches
from torchbay.distributed.unwrap import unwrap
from torchbay.errors import ConfigError
from torchbay.process import running
from torchbay.process.current import describe, set_current, start_device_backend
from torchbay.process.seeding import set_seed
from torchbay.process.state import AcceleratorState, DistributedType, distributed_type_for
from torchbay.registry.manager import get_plugin_manager
from torchbay.registry.resolve import config_model, resolve_config
from torchbay.registry.selection import build_context
from torchbay.telemetry.memory import add_oom_report
from torchbay.telemetry.monitor import TelemetryMonitor
from torchbay.tracking.run import RunTracking
from torchbay.tracking.trackers import split_log_with

#: what ``accumulate`` returns on a micro-batch that syncs (a nullcontext can be entered again and again)
_SYNC_STEP = contextlib.nullcontext()


def _explicit_args(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class Accelerator(Preparation, ProcessControl, Tracking, CheckpointedState, StateSaving, AcceleratorViews):
    """Runs your own training loop on the configured device, strategy and precision.

    Arguments left as ``None`` come from the config sources (defaults < YAML file <
    ``TORCHBAY_*`` env < CLI flags); given arguments win. ``config`` takes extra settings
    as a nested or dotted mapping (``{"mysection": {"some_key": False}}``).
    """

    def __init__(self, *, device: str | None = None, strategy: str | None = None, mixed_precision: str | None = None,
                 gradient_accumulation_steps: int | None = None,
                 dataloader_config: DataLoaderConfiguration | None = None, kwargs_handlers: Iterable[Any] = (),
                 project_config: ProjectConfiguration | None = None, project_dir: str | None = None,
                 config: dict[str, Any] | ResolvedConfig | None = None, config_file: str | None = None,
                 cpu: bool = False, seed: int | None = None, step_scheduler_with_optimizer: bool | None = None,
                 device_placement: bool | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None, log_with: Any = None,
                 **accelerate_args: Any):
        tracker_names, tracker_instances = split_log_with(log_with)
        sync_each_batch, adjust_scheduler, sync_with_dataloader = False, True, True
        if gradient_accumulation_plugin is not None:
            sync_each_batch = gradient_accumulation_plugin.sync_each_batch
            adjust_scheduler = gradient_accumulation_plugin.adjust_scheduler
            sync_with_dataloader = gradient_accumulation_plugin.sync_with_dataloader
            if gradient_accumulation_steps not in (None, gradient_accumulation_plugin.num_steps):
                raise ConfigError("gradient_accumulation_steps and gradient_accumulation_plugin.num_steps "
                                  "disagree; give one")
            gradient_accumulation_steps = gradient_accumulation_plugin.num_steps
        args = dict(config) if isinstance(config, dict) else {}
        args.update(translate_accelerate_arguments(accelerate_args))
        args.update(_explicit_args(device="cpu" if cpu else device, strategy=strategy, mixed_precision=mixed_precision,
                                   gradient_accumulation_steps=gradient_accumulation_steps, seed=seed,
                                   step_scheduler_with_optimizer=step_scheduler_with_optimizer,
                                   device_placement=device_placement))
        if dataloader_config is not None:
            args["dataloader"] = dataloader_config.to_config()
        if project_config is not None:
            args["project"] = project_config.to_config()
        if project_dir is not None:
            args["project.project_dir"] = project_dir
        if tracker_names is not None:
            args["tracking.log_with"] = tracker_names
        self.handlers = self._sort_handlers(kwargs_handlers)
        if self.handlers.get(InitProcessGroupKwargs):
            ipg = self.handlers[InitProcessGroupKwargs]
            if ipg.backend:
                args["process_group_backend"] = ipg.backend
            if ipg.timeout:
                args["process_group_timeout_s"] = ipg.timeout.total_seconds()

        self.pm = get_plugin_manager()
        sourced = settings_of_handlers(self.handlers.values(), self.pm)
        resolved = (config if isinstance(config, ResolvedConfig)
                    else resolve_config(file=config_file, args=args, pm=self.pm, sourced=sourced))
        check_handler_modes(self.handlers.values(), resolved.config.mixed_precision)
        _make_picklable(self.pm, resolved.config)
        self.context = build_context(resolved, self.pm)
        self.context.kwargs_handlers = self.handlers
        self.context.plugin_objects = plugin_objects(accelerate_args)
        self.config = resolved.config

        self.device_backend = self.context.device_backend = start_device_backend(self.context)
        self.strategy = self.context.strategy_cls(self.context)
        # decided once: whether accumulating micro-batches must enter the strategy's no_sync at all
        self._strategy_defers_sync = type(self.strategy).no_sync is not Strategy.no_sync
        self.context.strategy = self.strategy
        self.strategy.setup_environment(timeout_s=self.config.process_group_timeout_s)
        running.register_process_group_owner(self.strategy)
        if accelerate_args.get("parallelism_config") is not None:  # the user's object gets the strategy's mesh
            accelerate_args["parallelism_config"].device_mesh = self.strategy.device_mesh
        running.started(self)
        self.precision = self.strategy.adapt_precision(self.context.precision_cls(self.context))
        self.context.precision = self.precision
        io_cls = self.pm.registries()["checkpoint_io"][self.config.checkpoint.io]
        self.checkpoint_io = io_cls(max_shard_size=self.config.checkpoint.max_shard_size)
        self.checkpoint_io.trusted = self.config.checkpoint.allow_unsafe_pickle

        self.gradient_state = GradientState(self.config.gradient_accumulation_steps, sync_each_batch=sync_each_batch,
                                            sync_with_dataloader=sync_with_dataloader)
        self.gradient_state._adjust_scheduler = adjust_scheduler
        self._distributed_type = distributed_type_for(self.strategy, self.device_backend)
        self._adopt_state()
        self._setup_checkpointing()  # prepared_objects, training_state and the checkpointer given them
        self.tracking = RunTracking(self.context, self.training_state, tracker_instances)
        self.telemetry = (TelemetryMonitor(self.config.telemetry, self.config, self.device_backend, self.strategy,
                                           self.tracking, lambda: self._models, lambda: self._optimizers)
                          if self.config.telemetry.enabled else None)
        if self.config.seed is not None:
            set_seed(self.config.seed)

    def _adopt_state(self) -> None:
        """Make the process-wide ``AcceleratorState`` describe this accelerator (the latest one wins)."""
        run = describe(self.strategy, cpu=self.device_backend.name == "cpu",
                       mixed_precision=self.config.mixed_precision, distributed_type=self._distributed_type)
        run.hold_gradient_state(self.gradient_state)
        set_current(run)
        self.state = AcceleratorState()

    @staticmethod
    def _sort_handlers(handlers: Iterable[Any]) -> dict[type, Any]:
        known = (AutocastKwargs, GradScalerKwargs, DistributedDataParallelKwargs, InitProcessGroupKwargs,
                 ProfileKwargs)
        out: dict[type, Any] = {}
        for handler in handlers:
            kind = next((k for k in known if isinstance(handler, k)), type(handler))
            if kind in out:
                raise ConfigError(f"kwargs_handlers has two {kind.__name__} objects; pass one")
            out[kind] = handler
        return out

    # -- where am I ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.device_backend.device

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's kind of run (``DistributedType.MULTI_CPU``...); ``strategy.name`` is torchbay's."""
        return self._distributed_type

    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        """The ``dataloader`` settings as Accelerate's object; assigning one changes later ``prepare`` calls."""
        return DataLoaderConfiguration(**self.config.dataloader.model_dump())

    @dataloader_config.setter
    def dataloader_config(self, value: DataLoaderConfiguration) -> None:
        for key, item in value.to_config().items():
            setattr(self.config.dataloader, key, item)

    @property
    def mixed_precision(self) -> str:
        return self.config.mixed_precision

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.accumulation_steps = value

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        """As Accelerate's: force (or stop) synchronising gradients on the next steps."""
        self.gradient_state.set_sync_gradients(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def project_dir(self) -> str:
        return self.config.project.project_dir

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module: the strategy's wrapper and a user's ``DataParallel`` removed, ``torch.compile``'s
        kept around it unless ``keep_torch_compile=False``; ``keep_fp32_wrapper=False`` also removes the
        mixed-precision forward."""
        return unwrap(model, keep_fp32_wrapper, keep_torch_compile, strategy_unwrap=self.strategy.unwrap_model)

    # -- every step ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if not self.strategy.handles_accumulation and self.gradient_state.accumulation_steps > 1:
            loss = loss / self.gradient_state.accumulation_steps
        try:
            self.strategy.backward(self.precision.scale_loss(loss),
                                   sync_gradients=self.gradient_state.sync_gradients, **kwargs)
        except RuntimeError as exc:  # torch.OutOfMemoryError among them: say what the memory held
            self.explain_oom(exc)
            raise

    def explain_oom(self, exc: BaseException) -> None:
        """Add to an out-of-memory ``exc`` what this rank's memory held (parameters, gradients, optimizer state,
        the rest); with ``telemetry.memory_snapshot``, the allocator snapshot too. Other errors: nothing."""
        snapshots = self.telemetry.snapshot_dir() if self.telemetry is not None and self.telemetry.snapshots else None
        add_oom_report(exc, list(self._models), list(self._optimizers), self.device_backend,
                       self.process_index, snapshots)

    def pipeline_loss(self, model: Any, inputs: Any, target: Any, loss_fn: Any, **kwargs: Any) -> torch.Tensor:
        """The loss of ``model`` on one batch, ``loss_fn(model(*inputs, **kwargs), target)``, then given to
        :meth:`backward` as usual: the one line a loop changes for pipeline parallel (``parallelism.pp_size`` > 1),
        where the strategy runs the batch through the pipeline's schedule (forward and backward; ``backward``
        then has nothing left to do) and every rank gets the batch's loss (docs/parallelism.md)."""
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        return self.strategy.pipeline_loss(model, inputs, kwargs, target, loss_fn,
                                           accumulation_steps=self.gradient_state.accumulation_steps)

    def accumulate(self, *models: Any):
        """Accumulate gradients locally until the last micro-batch of the window, then sync.

        Called once per step: a micro-batch that syncs (or a strategy whose ``no_sync`` does
        nothing) gets one shared empty context (no generator, no exit stack), the others the
        strategy's ``no_sync`` of every model."""
        sync = self.gradient_state.advance()
        if sync or self.gradient_state.sync_each_batch or not models or not self._strategy_defers_sync:
            return _SYNC_STEP
        stack = contextlib.ExitStack()
        for model in models:
            stack.enter_context(self.strategy.no_sync(model))
        return stack

    @contextlib.contextmanager
    def no_sync(self, model: Any):
        with self.strategy.no_sync(model):
            yield

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        if autocast_handler is not None:
            return self.precision.forward_context(autocast_handler)
        return self.precision.forward_context()

    def unscale_gradients(self, optimizer: Any = None) -> None:
        prepared = [o for o in self._optimizers if optimizer is None or optimizer is o or optimizer is o.optimizer]
        if optimizer is not None and not prepared:  # an optimizer prepare() never saw
            self.precision.unscale_gradients(getattr(optimizer, "optimizer", optimizer))
        for opt in prepared:
            opt.unscale_gradients()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.unscale_gradients()
        return self.precision.clip_grad_norm_(parameters, max_norm, norm_type, self.strategy)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        self.unscale_gradients()
        self.strategy.clip_grad_value_(parameters, clip_value)

    # -- state ---------------------------------------------------------------------------
    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """One epoch of ``dataloader`` without its first ``num_batches`` (see torchbay.data.prepare)."""
        return skip_first_batches(dataloader, num_batches)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict (gathered from every rank when the strategy shards).

        Call it on every process: a sharding strategy gathers through a collective.
        """
        return self.strategy.model_state_dict(model)

    def save_model(self, model: Any, save_directory: str, max_shard_size: str = "10GB",
                   safe_serialization: bool = True) -> list[str]:
        """Write the full weights as (sharded) safetensors on the main process (``safe_serialization=False``:
        torch's ``pytorch_model.bin`` files, as Accelerate writes them).

        Call it on every process: a sharding strategy gathers the weights through a collective.
        The folder holds what Accelerate's save_model writes (``model.safetensors``, or shards and
        ``model.safetensors.index.json``), each file renamed into place once complete; other files
        there are left alone, a weights file torchbay did not write is never overwritten (the save
        is refused), and the weights files of an earlier torchbay save that this one does not
        rewrite are removed.
        """
        state = _offloaded_state(model)
        if state is None:
            state = self.get_state_dict(model)
        return self._checkpointer.save_model_files(state, save_directory, max_shard_size,
                                                   safe_serialization=bool(safe_serialization))

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` on the main process (safetensors for a dict of tensors with
        ``safe_serialization=True``, else ``torch.save``)."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, f, metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def free_memory(self, *objects: Any):
        """Drop torchbay's references to prepared objects and empty the device cache."""
        for bucket in (self._models, self._optimizers, self._schedulers, self._dataloaders):
            bucket.clear()
        gc.collect()
        self.device_backend.empty_cache()
        return [None] * len(objects) if len(objects) != 1 else None

    release_memory = free_memory

    def end_training(self) -> None:
        """Finish the trackers (closing their files), then tear down the process group; call at
        the end of a run (also done at exit). A save still in flight is finished first (its
        error is raised once the process group is torn down)."""
        try:
            self._finish_checkpoints()
        finally:
            self._close_trackers_and_group()

    def finish_at_exit(self) -> None:
        """At interpreter exit (process/running.py): flush and close what end_training was not called to close."""
        with contextlib.suppress(Exception):
            self.tracking.finish()
        self.strategy.teardown(barrier=False)

    def _close_trackers_and_group(self) -> None:
        try:
            if self.telemetry is not None:
                self.telemetry.finish()
            self.tracking.finish()
        finally:
            self.strategy.teardown()
            running.stopped(self)


def _offloaded_state(model: Any) -> dict[str, torch.Tensor] | None:
    """The full weights of a model dispatched with offloaded modules (brought in one module at a time), as
    Accelerate's ``save_model`` reads them; ``None`` for a model without offloaded modules."""
    from torchbay.big_modeling.align_hook import has_offloaded_params

    if not any(has_offloaded_params(m) for m in model.modules()):
        return None
    from torchbay.big_modeling.offload import get_state_dict_offloaded_model

    return get_state_dict_offloaded_model(model)


def _make_picklable(pm: Any, config: Any) -> None:
    """An Accelerator pickles (as Accelerate's does): its plugin manager by reference to this
    process's, its config (a class built at run time) by value."""
    copyreg.pickle(type(pm), lambda _: (get_plugin_manager, ()))
    copyreg.pickle(type(config), lambda c: (_rebuild_config, (c.model_dump(),)))


def _rebuild_config(data: dict[str, Any]) -> Any:
    return config_model(get_plugin_manager()).model_validate(data)
