"""Accelerate's FSDP names, answered by torchbay-fsdp (re-exported lazily by ``torchbay.utils``).

``FullyShardedDataParallelPlugin(...)`` takes Accelerate's fields and gives them to the
``fsdp`` config section (``Accelerator(fsdp_plugin=...)``); fields torchbay cannot honour are
errors naming the setting. ``merge_fsdp_weights`` consolidates a torchbay FSDP checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torchbay.errors import ConfigError

_SHARDING = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}
_WRAP = {"TRANSFORMER_BASED_WRAP": "transformer", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}


def _name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP settings object; ``to_config()`` gives torchbay's ``fsdp`` section."""

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

    def to_config(self) -> dict[str, Any]:
        """Dotted torchbay config values (``strategy: fsdp`` and the ``fsdp`` section)."""
        out: dict[str, Any] = {"strategy": "fsdp"}
        problems = []
        if self.fsdp_version is not None:
            out["fsdp.version"] = int(self.fsdp_version)
        reshard = self.reshard_after_forward if self.reshard_after_forward is not None else self.sharding_strategy
        if reshard is not None:
            if isinstance(reshard, bool):
                out["fsdp.reshard_after_forward"] = reshard
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
        if self.min_num_params is not None:
            out["fsdp.min_num_params"] = int(self.min_num_params)
        if self.backward_prefetch is not None:
            out["fsdp.backward_prefetch"] = _name(self.backward_prefetch)
        if self.cpu_offload is not None:
            out["fsdp.cpu_offload"] = bool(getattr(self.cpu_offload, "offload_params", self.cpu_offload))
        for name in ("activation_checkpointing", "cpu_ram_efficient_loading"):
            if getattr(self, name) is not None:
                out[f"fsdp.{name}"] = bool(getattr(self, name))
        for name, why in (("mixed_precision_policy", "set mixed_precision (and fsdp.param_dtype/reduce_dtype)"),
                          ("ignored_modules", "not supported"), ("param_init_fn", "build the model on the meta "
                                                                  "device with fsdp.cpu_ram_efficient_loading"),
                          ("state_dict_type", "torchbay saves sharded state (DCP) with save_state and full weights "
                                              "with save_model"),
                          ("state_dict_config", "see state_dict_type"), ("optim_state_dict_config", "see "
                                                                          "state_dict_type"),
                          ("activation_checkpointing_offload", "not supported")):
            if getattr(self, name) is not None:
                problems.append(f"FullyShardedDataParallelPlugin({name}=...): {why}")
        if problems:
            raise ConfigError(problems)
        return out

    def set_auto_wrap_policy(self, model: Any) -> None:
        """Accelerate reads the policy from the environment here; torchbay takes it from the config."""


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False) -> list[str]:
    """Write the full weights of a torchbay FSDP checkpoint as safetensors (``torchbay merge-weights``)."""
    from torchbay_fsdp.merge import merge_weights

    if not safe_serialization:
        raise ConfigError("merge_fsdp_weights(safe_serialization=False): torchbay writes safetensors only")
    written = merge_weights(checkpoint_dir, output_path)
    if remove_checkpoint_dir:  # only the files the checkpoint's manifest lists: never a user's file
        from torchbay.checkpoint_dir import remove_own_checkpoint

        remove_own_checkpoint(Path(checkpoint_dir), "merge_fsdp_weights(remove_checkpoint_dir=True)")
    return written
