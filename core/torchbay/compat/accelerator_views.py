"""Accelerate's Accelerator members that are views, not torchbay's own design: properties read from the run's config
and selected objects (``split_batches``, ``even_batches``, ``logging_dir``, ``is_fsdp2``, the N-D parallel ranks...),
and the Accelerate attributes torchbay refuses with what to use instead.

Mixin of :class:`~torchbay.accelerator.accelerator.Accelerator` (Accelerate's ``accelerate.accelerator`` path); the
members it reads from the Accelerator are declared below the class docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torchbay.config.handlers import ProfileKwargs
from torchbay.errors import ConfigError, UnsupportedAPIError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from torchbay.axes.precision import Precision
    from torchbay.axes.strategy import Strategy
    from torchbay.config.model import CoreConfig

#: Accelerator attributes of Accelerate's that torchbay does not have -> what to use instead
REFUSED_ATTRIBUTES = {
    "lomo_backward": "LOMO optimizers are not supported; use accelerator.backward with a torch optimizer",
    "deepspeed_ulysses_dl_adapter": "under parallelism.sp_size a prepared loader serves each rank's slice of the "
                                    "sequence once the model is prepared; drop the call and iterate the prepared "
                                    "loader",
    "verify_device_map": "big-model device maps are outside torchbay",
    "pipeline_parallel_rank": "N-D parallel ranks belong to the strategy plugins (torch DeviceMesh)",
}


class AcceleratorViews:
    """Accelerate's remaining Accelerator properties, read from torchbay's config and selected objects."""

    # what the views read from the Accelerator
    config: CoreConfig
    strategy: Strategy
    precision: Precision
    device: torch.device
    num_processes: int
    handlers: dict[type, Any]
    free_memory: Callable[..., Any]

    @property
    def split_batches(self) -> bool:
        return self.config.dataloader.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.config.dataloader.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.config.dataloader.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.config.dataloader.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.config.dataloader.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.config.dataloader.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.config.dataloader.use_stateful_dataloader

    @property
    def logging_dir(self):
        return self.config.project.logging_dir

    @property
    def fp8_backend(self) -> str | None:
        """Accelerate's name: the engine of ``mixed_precision="fp8"`` (the one ``auto`` chose), else None."""
        return self.precision.engine if self.config.mixed_precision == "fp8" else None

    @property
    def is_fsdp2(self) -> bool:
        return bool(getattr(self.strategy, "is_fully_sharded_v2", False))

    @property
    def multi_device(self) -> bool:
        return self.num_processes > 1 and self.device.type != "cpu"

    @property
    def should_save_model(self) -> bool:
        return True

    # -- N-D parallelism: answered by the selected strategy ---------------------------------
    @property
    def data_parallel_rank(self) -> int:
        """Which part of each global batch this process reads (the same within a tp/cp group)."""
        return self.strategy.data_parallel_rank

    @property
    def torch_device_mesh(self):
        """The strategy's named ``DeviceMesh`` (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, flattened ``dp``...)."""
        return self.strategy.device_mesh

    @property
    def parallelism_config(self):
        return self.strategy.parallelism_config

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.strategy.parallelism_config is not None

    def _mesh_rank(self, dim: str) -> int:
        mesh = self.strategy.device_mesh
        if mesh is None or dim not in (mesh.mesh_dim_names or ()):

            raise ConfigError(f"the parallel dimension '{dim}' is not enabled (parallelism.{dim}_size is 1 or the "
                              f"strategy builds no device mesh); set parallelism.{dim}_size")
        return mesh.get_local_rank(dim)

    @property
    def tensor_parallel_rank(self) -> int:
        return self._mesh_rank("tp")

    @property
    def context_parallel_rank(self) -> int:
        return self._mesh_rank("cp")

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._mesh_rank("dp_shard")

    def maybe_context_parallel(self, buffers: list | None = None, buffer_seq_dims: list | None = None,
                               no_restore_buffers: set | None = None):
        """Shard the sequence dimension of ``buffers`` across the context-parallel group inside the
        block (no-op without context parallelism), as Accelerate's method does."""
        return self.strategy.context_parallel(buffers, buffer_seq_dims, no_restore_buffers)

    def clear(self, *objects: Any):
        return self.free_memory(*objects)

    def profile(self, profile_handler: Any = None):
        """A ``torch.profiler.profile`` with the ``ProfileKwargs`` given (or passed to the Accelerator)."""
        handler = profile_handler or self.handlers.get(ProfileKwargs) or ProfileKwargs()
        return handler.build()

    def __getattr__(self, name: str):
        if name in REFUSED_ATTRIBUTES:

            raise UnsupportedAPIError(f"Accelerator.{name} is not offered by torchbay: {REFUSED_ATTRIBUTES[name]}")
        prop = getattr(type(self), name, None)
        if isinstance(prop, property) and prop.fget is not None:
            return prop.fget(self)  # a property raised AttributeError (StateResetError...): let its own error show
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
