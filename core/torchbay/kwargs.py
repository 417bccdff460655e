"""Settings objects with Accelerate's names, passed to ``Accelerator(...)``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Optional


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


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


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
    use_seedable_sampler: bool = True
    data_seed: Optional[int] = None
    non_blocking: bool = False

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
    """Accelerate's way of giving ``num_steps``; same as ``gradient_accumulation_steps``."""

    num_steps: int = 1
    sync_with_dataloader: bool = True
