"""The ``Accelerator``: the user-facing API, with Hugging Face Accelerate's names.

It resolves the config, selects a device, strategy and precision through the plugin
manager, joins the process group when there are several processes, and from then on calls
plain methods of the selected objects (no hook dispatch per step).
"""

from __future__ import annotations

import atexit
import contextlib
import copyreg
import functools
import gc
import weakref
from typing import Any, Iterable

import torch
from torch.utils.data import DataLoader, IterableDataset

from torchbay import operations
from torchbay.accelerator_args import AccelerateSurface
from torchbay.accelerator_args import translate as translate_accelerate_arguments
from torchbay.accelerator_process import ProcessControl
from torchbay.checkpointing import StateCheckpointer
from torchbay.config import ResolvedConfig, resolve_config
from torchbay.data import DataLoaderDispatcher, DataLoaderShard, LoaderSettings, PreparedDataLoader, SkipFirstBatches
from torchbay.errors import ConfigError, TorchbayError
from torchbay.kwargs import (AutocastKwargs, DataLoaderConfiguration, DistributedDataParallelKwargs,
                             GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs,
                             ProjectConfiguration)
from torchbay.plugins import get_plugin_manager
from torchbay.selection import build_context
from torchbay.state import AcceleratorState, DistributedType, PartialState, distributed_type_for, \
    register_process_group_owner
from torchbay.utils import set_seed
from torchbay.wrappers import GradientState, PreparedOptimizer, PreparedScheduler


def _explicit_args(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class Accelerator(ProcessControl, AccelerateSurface):
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
        if log_with not in (None, [], ()):
            raise ConfigError("log_with: experiment trackers are not part of torchbay yet; log from "
                              "accelerator.is_main_process with your tracker's own API")
        sync_each_batch = False
        if gradient_accumulation_plugin is not None:
            sync_each_batch = gradient_accumulation_plugin.sync_each_batch
            if not gradient_accumulation_plugin.sync_with_dataloader:
                raise ConfigError("gradient_accumulation_plugin.sync_with_dataloader=False is not supported: "
                                  "torchbay always syncs gradients on the last batch of a data loader")
            if gradient_accumulation_steps not in (None, gradient_accumulation_plugin.num_steps):
                raise ConfigError("gradient_accumulation_steps and gradient_accumulation_plugin.num_steps disagree; give one")
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
        self.handlers = self._sort_handlers(kwargs_handlers)
        if self.handlers.get(InitProcessGroupKwargs):
            ipg = self.handlers[InitProcessGroupKwargs]
            if ipg.backend:
                args["process_group_backend"] = ipg.backend
            if ipg.timeout:
                args["process_group_timeout_s"] = ipg.timeout.total_seconds()

        self.pm = get_plugin_manager()
        resolved = config if isinstance(config, ResolvedConfig) else resolve_config(file=config_file, args=args, pm=self.pm)
        _make_picklable(self.pm, resolved.config)
        self.context = build_context(resolved, self.pm)
        self.context.accelerator = self
        self.context.kwargs_handlers = self.handlers
        self.config = resolved.config

        self.device_backend = self.context.device_backend_cls(self.context.cluster.local_rank())
        self.context.device_backend = self.device_backend
        self.device_backend.set_current()
        self.strategy = self.context.strategy_cls(self.context)
        self.context.strategy = self.strategy
        self.strategy.setup_environment(timeout_s=self.config.process_group_timeout_s)
        register_process_group_owner(self.strategy)
        _live.add(self)
        self.precision = self.strategy.adapt_precision(self.context.precision_cls(self.context))
        self.context.precision = self.precision
        io_cls = self.pm.registries()["checkpoint_io"][self.config.checkpoint.io]
        self.checkpoint_io = io_cls(max_shard_size=self.config.checkpoint.max_shard_size)
        self.checkpoint_io.trusted = self.config.checkpoint.allow_unsafe_pickle

        self.gradient_state = GradientState(self.config.gradient_accumulation_steps, sync_each_batch=sync_each_batch)
        self._distributed_type = distributed_type_for(self.strategy, self.device_backend)
        self._adopt_state()
        self.save_iteration = self.config.project.iteration
        self._models: list[Any] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list[Any] = []
        self._checkpointer = StateCheckpointer(self)
        if self.config.seed is not None:
            set_seed(self.config.seed)

    def _adopt_state(self) -> None:
        """Make the process-wide ``AcceleratorState`` describe this accelerator (the latest one wins)."""
        PartialState._adopt(PartialState.__new__(PartialState), self.strategy, cpu=self.device_backend.name == "cpu",
                            mixed_precision=self.config.mixed_precision)
        PartialState._shared_state["distributed_type"] = self._distributed_type
        PartialState._shared_state["_gradient_state"] = self.gradient_state
        self.state = AcceleratorState.__new__(AcceleratorState)
        self.state.__dict__ = PartialState._shared_state

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

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def project_dir(self) -> str:
        return self.config.project.project_dir

    # -- prepare -----------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and data loaders (any order, any number of calls)."""
        self.state.distributed_type  # noqa: B018 (raises StateResetError after AcceleratorState._reset_state())
        objects = [self.precision.convert_module(o) if isinstance(o, torch.nn.Module) else o for o in objects]
        kinds = [self._kind(o) for o in objects]
        for obj, kind in zip(objects, kinds):
            if kind == "dataloader":
                self.strategy.connect_dataloader(obj)
        models = [o for o, k in zip(objects, kinds) if k == "model"]
        optimizers = [o for o, k in zip(objects, kinds) if k == "optimizer"]
        schedulers = [o for o, k in zip(objects, kinds) if k == "scheduler"]
        models, optimizers = self.precision.prepare(models, optimizers)
        models, optimizers, schedulers = self.strategy.setup(models, optimizers, schedulers)
        models = [self._wrap_forward(m) for m in models]
        prepared_opts = [PreparedOptimizer(o, self) for o in optimizers]
        self._models += models
        self._optimizers += prepared_opts
        queues = {"model": iter(models), "optimizer": iter(prepared_opts), "scheduler": iter(schedulers)}
        result = []
        for obj, kind in zip(objects, kinds):
            if kind in queues:
                obj = next(queues[kind])
                if kind == "scheduler":
                    obj = PreparedScheduler(obj, self._optimizers_for(obj), self)
                    self._schedulers.append(obj)
            elif kind == "dataloader":
                obj = self.prepare_data_loader(obj)
            result.append(obj)
        return result[0] if len(result) == 1 else tuple(result)

    @staticmethod
    def _kind(obj: Any) -> str:
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

            @functools.wraps(original)
            def forward(*args, **kwargs):
                with precision.forward_context():
                    return original(*args, **kwargs)

            inner._torchbay_original_forward = original
            inner.forward = operations.convert_outputs_to_fp32(forward) if precision.fp32_outputs else forward
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
            return self._wrap_forward(model)
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> PreparedOptimizer:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        return self.prepare(scheduler)

    def prepare_data_loader(self, dataloader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> PreparedDataLoader:
        if slice_fn_for_dispatch is not None:
            raise ConfigError("prepare_data_loader(slice_fn_for_dispatch=...) is not supported: dispatched batches "
                              "are sliced along dim 0 of every tensor")
        cfg = self.config.dataloader
        seed = cfg.data_seed if cfg.data_seed is not None else self.strategy.broadcast_object(torch.initial_seed() % 2**62)
        placement = self.config.device_placement if device_placement is None else device_placement
        dispatch = cfg.dispatch_batches
        if dispatch is None:  # Accelerate's default: the main process reads iterable datasets
            dispatch = placement and isinstance(dataloader.dataset, IterableDataset)
        settings = LoaderSettings(num_processes=self.num_processes, process_index=self.process_index,
                                  device=self.device if placement else None, split_batches=cfg.split_batches,
                                  even_batches=cfg.even_batches, dispatch_batches=dispatch,
                                  use_seedable_sampler=cfg.use_seedable_sampler, non_blocking=cfg.non_blocking,
                                  use_stateful_dataloader=cfg.use_stateful_dataloader)
        cls = DataLoaderDispatcher if dispatch else DataLoaderShard
        loader = cls(dataloader, settings=settings, seed=seed, strategy=self.strategy,
                     gradient_state=self.gradient_state, device_backend=self.device_backend)
        self._dataloaders.append(loader)
        return loader

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module; ``keep_fp32_wrapper=False`` also removes the mixed-precision forward."""
        inner = self.strategy.unwrap_model(model)
        if not keep_fp32_wrapper and hasattr(inner, "_torchbay_original_forward"):
            inner.forward = inner._torchbay_original_forward
            del inner._torchbay_original_forward
        return inner

    # -- every step ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if not self.strategy.handles_accumulation and self.gradient_state.accumulation_steps > 1:
            loss = loss / self.gradient_state.accumulation_steps
        self.strategy.backward(self.precision.scale_loss(loss), **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: Any):
        """Accumulate gradients locally until the last micro-batch of the window, then sync."""
        sync = self.gradient_state.advance()
        with contextlib.ExitStack() as stack:
            if not sync and not self.gradient_state.sync_each_batch:
                for model in models:
                    stack.enter_context(self.strategy.no_sync(model))
            yield

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
    def register_for_checkpointing(self, *objects: Any) -> None:
        bad = [type(o).__name__ for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise TorchbayError(f"register_for_checkpointing needs objects with state_dict() and load_state_dict(); "
                                f"these have not: {', '.join(bad)}")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | None = None, **_ignored: Any) -> str:
        return str(self._checkpointer.save(output_dir))

    def load_state(self, input_dir: str | None = None, **_ignored: Any) -> str:
        return str(self._checkpointer.load(input_dir))

    def _training_state(self) -> dict[str, Any]:
        return {"gradient_step": self.gradient_state.step, "save_iteration": self.save_iteration,
                "dataloaders": [dl.state_dict() for dl in self._dataloaders]}

    def _load_training_state(self, state: dict[str, Any]) -> None:
        self.gradient_state.step = int(state["gradient_step"])
        for loader, dl_state in zip(self._dataloaders, state["dataloaders"]):
            loader.load_state_dict(dl_state)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> SkipFirstBatches:
        if not isinstance(dataloader, PreparedDataLoader):
            raise TorchbayError("skip_first_batches takes a data loader returned by accelerator.prepare")
        return SkipFirstBatches(dataloader, num_batches)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict (gathered from every rank when the strategy shards).

        Call it on every process: a sharding strategy gathers through a collective.
        """
        return self.strategy.model_state_dict(model)

    def save_model(self, model: Any, save_directory: str, max_shard_size: str = "10GB",
                   safe_serialization: bool = True) -> list[str]:
        """Write the full weights as (sharded) safetensors on the main process.

        Call it on every process: a sharding strategy gathers the weights through a collective.
        The directory is published atomically, like save_state: it must be new, empty or an
        earlier torchbay checkpoint, and no file of an earlier save survives next to the new one.
        """
        state = self.get_state_dict(model)
        return self._checkpointer.save_model_files(state, save_directory, max_shard_size)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        if self.is_main_process:
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
        """Tear down the process group; call at the end of a run (also done at exit)."""
        self.strategy.teardown()
        _live.discard(self)


def _make_picklable(pm: Any, config: Any) -> None:
    """An Accelerator pickles (as Accelerate's does): its plugin manager by reference to this
    process's, its config (a class built at run time) by value."""
    copyreg.pickle(type(pm), lambda _: (get_plugin_manager, ()))
    copyreg.pickle(type(config), lambda c: (_rebuild_config, (c.model_dump(),)))


def _rebuild_config(data: dict[str, Any]) -> Any:
    from torchbay.config import config_model

    return config_model(get_plugin_manager()).model_validate(data)


_live: "weakref.WeakSet[Accelerator]" = weakref.WeakSet()


def live_device_backends() -> list[Any]:
    return [acc.device_backend for acc in list(_live)]


@atexit.register
def _teardown_at_exit() -> None:
    # gloo can abort a rank at interpreter exit while a process group is alive
    for accelerator in list(_live):
        with contextlib.suppress(Exception):
            accelerator.strategy.teardown(barrier=False)


