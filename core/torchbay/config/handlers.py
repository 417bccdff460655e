"""Settings objects with Accelerate's names, passed to ``Accelerator(...)``."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Optional

from torchbay.errors import ConfigError


class KwargsHandler:
    """Base of the ``kwargs_handlers`` objects: ``to_kwargs()`` gives the non-default values."""

    def to_kwargs(self) -> dict[str, Any]:
        defaults = type(self)().__dict__
        return {k: v for k, v in self.__dict__.items() if defaults.get(k) != v}


@dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: Optional[bool] = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


class DDPCommunicationHookType(str, enum.Enum):
    """Gradient communication hooks of torch's DDP, by Accelerate's names."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """``DistributedDataParallel`` arguments, plus a communication hook (``comm_hook``), optionally
    wrapped (``comm_wrapper``: fp16/bf16 compression of PowerSGD), with ``comm_state_option``
    passed to ``PowerSGDState``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    _HOOK_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")

    def ddp_kwargs(self) -> dict[str, Any]:
        """The non-default arguments for ``DistributedDataParallel`` itself."""
        return {k: v for k, v in self.to_kwargs().items() if k not in self._HOOK_FIELDS}

    def register_comm_hook(self, model: Any) -> None:
        """Register the chosen hook on a ``DistributedDataParallel`` model (nothing for ``NO``)."""
        hook_kind = DDPCommunicationHookType(self.comm_hook)
        wrapper_kind = DDPCommunicationHookType(self.comm_wrapper)
        if hook_kind is DDPCommunicationHookType.NO:
            if wrapper_kind is not DDPCommunicationHookType.NO:

                raise ConfigError("DistributedDataParallelKwargs.comm_wrapper wraps a comm_hook; set comm_hook too "
                                  "(e.g. DDPCommunicationHookType.POWER_SGD)")
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
                 DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
                 DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
                 DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
        wrappers = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
                    DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper}
        hook = hooks[hook_kind]
        if wrapper_kind in wrappers:
            hook = wrappers[wrapper_kind](hook)
        state = None
        if hook_kind in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD):
            state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of ``accelerator.profile()`` (``torch.profiler.profile``), Accelerate's fields."""

    activities: Optional[list] = None  # names: "cpu" or a device's profiler activity name
    schedule_option: Optional[dict] = None  # wait, warmup, active, repeat, skip_first
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[str] = None

    def build(self):
        """A ``torch.profiler.profile`` with these settings."""
        import torch.profiler as tp

        activities = None
        if self.activities is not None:
            table = {n.lower(): a for n, a in tp.ProfilerActivity.__members__.items()}
            unknown = [a for a in self.activities if a.lower() not in table]
            if unknown:

                raise ConfigError(f"ProfileKwargs.activities: unknown {unknown}; choose from {sorted(table)}")
            activities = [table[a.lower()] for a in self.activities]
        schedule = tp.schedule(**self.schedule_option) if self.schedule_option else None
        on_trace_ready = self.on_trace_ready
        if on_trace_ready is None and self.output_trace_dir:
            on_trace_ready = tp.tensorboard_trace_handler(self.output_trace_dir)
        return tp.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready,
                          record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                          with_stack=self.with_stack, with_flops=self.with_flops, with_modules=self.with_modules)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    backend: Optional[str] = None
    timeout: Optional[timedelta] = None


@dataclass
class DataLoaderConfiguration:
    """Same fields and meaning as Accelerate's; overrides the ``dataloader`` config section."""

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    #: True: after load_state/load_state_dict, iterating a prepared loader goes on from the saved
    #: position (torchbay's loaders save it either way; without this use skip_first_batches)
    use_stateful_dataloader: bool = False

    def to_config(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ProjectConfiguration:
    """Where checkpoints go and how many are kept; overrides the ``project`` section."""

    project_dir: str = "."
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0

    def to_config(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GradientAccumulationPlugin:
    """Accelerate's way of giving ``num_steps``; same as ``gradient_accumulation_steps``.

    ``sync_each_batch=True`` synchronises gradients on every micro-batch (less memory, more
    communication); the optimizer still steps every ``num_steps``. ``adjust_scheduler`` (Accelerate's
    default, True) counts the micro-batches that do not step in a prepared scheduler's ``_step_count``.
    """

    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
