"""Accelerate's ``FullyShardedDataParallelPlugin``: the settings object a user gives ``Accelerator(fsdp_plugin=...)``
and ``accelerator.state.fsdp_plugin`` shows (re-exported by :mod:`torchbay_fsdp.compat`, whose Accelerate functions
sit above the strategy; this object sits below it, since the strategy builds one).

Cheap to import: ``torch.distributed.fsdp``'s enums and configs are imported when a state-dict type is set
(:mod:`torchbay_fsdp.compat` is imported with transformers' Trainer, in processes that may never run FSDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torchbay.errors import ConfigError

_SHARDING = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}
_WRAP = {"TRANSFORMER_BASED_WRAP": "transformer", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}
#: state_dict_type values torchbay writes (StateDictType's numbers: 1 FULL, 2 LOCAL, 3 SHARDED)
_STATE_DICT_TYPES = {"FULL_STATE_DICT": "FULL_STATE_DICT", "1": "FULL_STATE_DICT",
                     "SHARDED_STATE_DICT": "SHARDED_STATE_DICT", "3": "SHARDED_STATE_DICT"}


def _name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


def _state_dict_type(value: Any) -> Any:
    """torch's ``StateDictType`` member for ``value`` (a member, its name or its number)."""
    from torch.distributed.fsdp import StateDictType

    name = _STATE_DICT_TYPES.get(_name(value))
    if name is None:
        raise ConfigError(f"FullyShardedDataParallelPlugin(state_dict_type={_name(value)}): torchbay's fsdp writes "
                          f"FULL_STATE_DICT (one file, written by rank 0) or SHARDED_STATE_DICT (DCP, every rank "
                          f"its shards); LOCAL_STATE_DICT does not exist in FSDP2: use SHARDED_STATE_DICT")
    return StateDictType[name]


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP settings object; ``to_config()`` gives torchbay's ``fsdp`` section.

    Mapped onto the ``fsdp`` section: ``fsdp_version``, ``sharding_strategy`` /
    ``reshard_after_forward`` (FULL_SHARD, SHARD_GRAD_OP or a bool), ``auto_wrap_policy`` (by name),
    ``transformer_cls_names_to_wrap``, ``min_num_params``, ``backward_prefetch``, ``cpu_offload``,
    ``activation_checkpointing``, ``cpu_ram_efficient_loading``, and with ``fsdp_version=1``
    ``sync_module_states=True`` (rank 0's weights broadcast: ``fsdp.cpu_ram_efficient_loading``).

    Kept on this object for :func:`save_fsdp_model` and friends: ``state_dict_type``
    (FULL_STATE_DICT or SHARDED_STATE_DICT; unset: SHARDED_STATE_DICT for FSDP2, as Accelerate),
    ``state_dict_config`` and ``optim_state_dict_config`` (their ``offload_to_cpu``; with several
    processes a full state dict is always gathered to rank 0 on CPU, as Accelerate does).

    Accepted without an effect, since they cannot change results: ``limit_all_gathers`` (an FSDP1
    rate limiter; FSDP2 has none), ``use_orig_params=True`` (torchbay always keeps the original
    parameters), ``forward_prefetch=False`` and ``activation_checkpointing_offload=False``,
    ``sync_module_states`` with FSDP2 (obsolete there, as Accelerate says).

    Errors (ConfigError naming the field) when set to a value that would change results or that
    torchbay cannot do: ``mixed_precision_policy`` (set ``mixed_precision`` instead),
    ``ignored_modules``, ``param_init_fn`` (build the model on the meta device with
    ``fsdp.cpu_ram_efficient_loading``), ``use_orig_params=False``, ``forward_prefetch=True``,
    ``activation_checkpointing_offload=True``, ``state_dict_type=LOCAL_STATE_DICT``, an
    ``auto_wrap_policy`` callable, a sharding strategy other than FULL_SHARD / SHARD_GRAD_OP.
    """

    fsdp_version: Optional[int] = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: Optional[bool] = None
    param_init_fn: Any = None
    sync_module_states: Optional[bool] = None
    forward_prefetch: Optional[bool] = None
    activation_checkpointing: Optional[bool] = None
    activation_checkpointing_offload: Optional[bool] = None
    cpu_ram_efficient_loading: Optional[bool] = None
    transformer_cls_names_to_wrap: Optional[list] = None
    min_num_params: Optional[int] = None

    def __post_init__(self) -> None:
        if self.state_dict_type is not None:
            self.set_state_dict_type()

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Accelerate's method: ``state_dict_type`` as torch's enum, with the matching default configs
        (e.g. a run that trains with SHARDED_STATE_DICT and saves its final weights with FULL_STATE_DICT)."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
            self.state_dict_config = self.optim_state_dict_config = None
        if self.state_dict_type is None:
            self.state_dict_type = "SHARDED_STATE_DICT" if (self.fsdp_version or 2) == 2 else "FULL_STATE_DICT"
        self.state_dict_type = _state_dict_type(self.state_dict_type)
        if self.state_dict_type == StateDictType.FULL_STATE_DICT:
            self.state_dict_config = self.state_dict_config or FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            self.optim_state_dict_config = self.optim_state_dict_config or FullOptimStateDictConfig(
                offload_to_cpu=True, rank0_only=True)
        else:
            self.state_dict_config = self.state_dict_config or ShardedStateDictConfig(offload_to_cpu=True)
            self.optim_state_dict_config = self.optim_state_dict_config or ShardedOptimStateDictConfig(
                offload_to_cpu=True)

    @classmethod
    def from_settings(cls, settings: Any) -> "FullyShardedDataParallelPlugin":
        """The object ``accelerator.state.fsdp_plugin`` shows for a run configured without one."""
        plugin = cls(fsdp_version=settings.version, reshard_after_forward=settings.reshard_after_forward,
                     cpu_offload=settings.cpu_offload, activation_checkpointing=settings.activation_checkpointing,
                     cpu_ram_efficient_loading=settings.cpu_ram_efficient_loading,
                     transformer_cls_names_to_wrap=list(settings.transformer_layer_cls_to_wrap) or None,
                     min_num_params=settings.min_num_params if settings.wrap_policy == "size" else None,
                     auto_wrap_policy={v: k for k, v in _WRAP.items()}[settings.wrap_policy].lower())
        plugin.set_state_dict_type()
        return plugin

    def fill_from(self, settings: Any) -> None:
        """Fields left unset take what the run uses (``fsdp_version``, ``activation_checkpointing``...)."""
        if self.fsdp_version is None:
            self.fsdp_version = settings.version
        for name in ("activation_checkpointing", "cpu_ram_efficient_loading"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(settings, name))
        if not isinstance(self.reshard_after_forward, bool) and self.fsdp_version == 2:
            self.reshard_after_forward = settings.reshard_after_forward
        self.set_state_dict_type()

    def to_config(self) -> dict[str, Any]:
        """Dotted torchbay config values (``strategy: fsdp`` and the ``fsdp`` section)."""
        out: dict[str, Any] = {"strategy": "fsdp"}
        problems = []
        if self.fsdp_version is not None:
            out["fsdp.version"] = int(self.fsdp_version)
        version = int(self.fsdp_version or 2)
        reshard = self.reshard_after_forward if self.reshard_after_forward is not None else self.sharding_strategy
        if reshard is not None:
            if isinstance(reshard, bool):
                out["fsdp.reshard_after_forward"] = reshard
            elif isinstance(reshard, str) and reshard.lower() in ("true", "false"):
                out["fsdp.reshard_after_forward"] = reshard.lower() == "true"
            elif _name(reshard) in _SHARDING:
                out["fsdp.reshard_after_forward"] = _SHARDING[_name(reshard)]
            else:
                problems.append(f"FullyShardedDataParallelPlugin(sharding_strategy={_name(reshard)}): torchbay's fsdp "
                                f"supports FULL_SHARD and SHARD_GRAD_OP (fsdp.reshard_after_forward true/false)")
        if self.auto_wrap_policy is not None:
            policy = self.auto_wrap_policy
            if isinstance(policy, str) and _name(policy) in _WRAP:
                out["fsdp.wrap_policy"] = _WRAP[_name(policy)]
            else:
                problems.append("FullyShardedDataParallelPlugin(auto_wrap_policy=<callable>): give the policy's name "
                                "(transformer_based_wrap, size_based_wrap, no_wrap)")
        if self.transformer_cls_names_to_wrap:
            names = self.transformer_cls_names_to_wrap
            out["fsdp.transformer_layer_cls_to_wrap"] = names.split(",") if isinstance(names, str) else list(names)
        if self.min_num_params is not None and out.get("fsdp.wrap_policy") != "transformer":
            out["fsdp.min_num_params"] = int(self.min_num_params)
        if self.backward_prefetch is not None:
            prefetch = _name(self.backward_prefetch)
            if not (version == 2 and prefetch == "NO_PREFETCH"):  # Trainer's default; FSDP2 has no such setting
                out["fsdp.backward_prefetch"] = prefetch
        if self.cpu_offload is not None:
            out["fsdp.cpu_offload"] = bool(getattr(self.cpu_offload, "offload_params", self.cpu_offload))
        for name in ("activation_checkpointing", "cpu_ram_efficient_loading"):
            if getattr(self, name) is not None:
                out[f"fsdp.{name}"] = bool(getattr(self, name))
        if version == 1 and self.sync_module_states:
            out["fsdp.cpu_ram_efficient_loading"] = True  # rank 0's weights broadcast to every rank
        if self.state_dict_type is not None:
            _state_dict_type(self.state_dict_type)  # FULL or SHARDED, else the error says which
        for name, why in (("mixed_precision_policy", "set mixed_precision (and fsdp.param_dtype/reduce_dtype)"),
                          ("ignored_modules", "not supported"), ("param_init_fn", "build the model on the meta "
                                                                  "device with fsdp.cpu_ram_efficient_loading")):
            if getattr(self, name) is not None:
                problems.append(f"FullyShardedDataParallelPlugin({name}=...): {why}")
        for name, refused, why in (
                ("use_orig_params", False, "torchbay's fsdp always keeps the original parameters; leave it unset "
                                           "or True"),
                ("forward_prefetch", True, "forward prefetching is not a torchbay fsdp setting; leave it unset"),
                ("activation_checkpointing_offload", True,
                 "offloading checkpointed activations is not supported; "
                 "leave it unset (fsdp.activation_checkpointing recomputes)")):
            if getattr(self, name) is refused:
                problems.append(f"FullyShardedDataParallelPlugin({name}={refused}): {why}")
        if problems:
            raise ConfigError(problems)
        return out

    def set_auto_wrap_policy(self, model: Any) -> None:
        """Accelerate reads the policy from the environment here; torchbay takes it from the config."""
