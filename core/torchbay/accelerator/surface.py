"""Accelerate's ``Accelerator(...)`` arguments that torchbay takes as config, or refuses with advice.

A backend plugin object (``fsdp_plugin=``, ``deepspeed_plugin=``) comes from that backend's
torchbay plugin and gives its settings as config (``to_config()``); arguments for features
torchbay does not have raise a :class:`~torchbay.errors.ConfigError` naming what to use.
"""

from __future__ import annotations

from typing import Any

from torchbay.compile.compiler import dynamo_arguments
from torchbay.config.handlers import ProfileKwargs
from torchbay.errors import ConfigError, UnsupportedAPIError

#: Accelerator(...) argument -> why torchbay refuses it, and what to do instead
REFUSED = {
    "torch_tp_plugin": "tensor parallelism is configured in a strategy plugin's config section",
    "megatron_lm_plugin": "Megatron-LM is not a torchbay strategy",
}
#: arguments whose value is a backend plugin's settings object
PLUGIN_OBJECTS = ("fsdp_plugin", "deepspeed_plugin", "deepspeed_plugins")


def plugin_objects(arguments: dict[str, Any]) -> dict[str, Any]:
    """The backend plugin objects among ``Accelerator(...)``'s arguments (the active one of a dict), by name."""
    out = {}
    for name in PLUGIN_OBJECTS:
        value = arguments.get(name)
        if isinstance(value, dict) and len(value) == 1:
            value = next(iter(value.values()))
        if value is not None and not isinstance(value, dict):
            out["deepspeed_plugin" if name == "deepspeed_plugins" else name] = value
    return out


def translate(arguments: dict[str, Any]) -> dict[str, Any]:
    """Dotted config values for Accelerate-only ``Accelerator`` arguments (unknown ones are errors)."""
    out: dict[str, Any] = {}
    problems = []
    arguments = dict(arguments)
    dynamo = (arguments.pop("dynamo_backend", None), arguments.pop("dynamo_plugin", None))
    try:
        out.update(dynamo_arguments(*dynamo))  # the compile section (torchbay.compile.compiler)
    except ConfigError as exc:
        problems += exc.problems
    for name, value in arguments.items():
        if name in REFUSED:
            if value is not None:
                problems.append(f"Accelerator({name}=...) is not supported: {REFUSED[name]}")
        elif name in PLUGIN_OBJECTS:
            if value is None:
                continue
            if isinstance(value, dict):  # Accelerate's named deepspeed_plugins: the first is the active one
                if len(value) != 1:
                    problems.append(f"Accelerator({name}=...) with several named plugins is not supported: "
                                    f"prepare each model with its own Accelerator")
                    continue
                value = next(iter(value.values()))
            to_config = getattr(value, "to_config", None)
            if to_config is None:
                problems.append(f"Accelerator({name}=...) takes the object from the torchbay plugin "
                                f"(torchbay.utils.{type(value).__name__}), not {type(value).__module__}'s")
                continue
            out.update(to_config())
        elif name == "parallelism_config":
            if value is None:
                continue
            to_config = getattr(value, "to_config", None)
            if to_config is None:
                problems.append(f"Accelerator(parallelism_config=...) takes torchbay.ParallelismConfig, not "
                                f"{type(value).__module__}.{type(value).__name__}")
                continue
            out.update(to_config())
        elif name == "split_batches":
            out["dataloader.split_batches"] = bool(value)
        elif name == "rng_types":
            if value and any(str(getattr(v, "value", v)) not in ("torch", "generator") for v in value):
                problems.append("Accelerator(rng_types=...): torchbay synchronises the samplers' generators "
                                "itself; leave rng_types unset")
        elif name == "even_batches":
            out["dataloader.even_batches"] = bool(value)
        elif name == "dispatch_batches":
            out["dataloader.dispatch_batches"] = value
        else:
            problems.append(f"Accelerator() got an unexpected argument {name!r}")
    if problems:
        raise ConfigError(problems)
    return out


#: Accelerator attributes of Accelerate's that torchbay does not have -> what to use instead
REFUSED_ATTRIBUTES = {
    "lomo_backward": "LOMO optimizers are not supported; use accelerator.backward with a torch optimizer",
    "deepspeed_ulysses_dl_adapter": "sequence parallelism belongs to a strategy plugin",
    "verify_device_map": "big-model device maps are outside torchbay",
    "pipeline_parallel_rank": "N-D parallel ranks belong to the strategy plugins (torch DeviceMesh)",
}


class AccelerateSurface:
    """Accelerate's remaining Accelerator properties, read from torchbay's config."""

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
