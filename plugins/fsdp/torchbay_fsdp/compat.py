"""Accelerate's FSDP names, answered by torchbay-fsdp (re-exported lazily by ``torchbay.utils``).

``FullyShardedDataParallelPlugin(...)`` (:mod:`torchbay_fsdp.accelerate_plugin`) takes Accelerate's fields and
gives them to the ``fsdp`` config section (``Accelerator(fsdp_plugin=...)``); ``accelerator.state.fsdp_plugin`` is
that object (or one built from the ``fsdp`` section). ``save_fsdp_model``, ``load_fsdp_model``,
``save_fsdp_optimizer`` and ``load_fsdp_optimizer`` have Accelerate's signatures and files
(transformers' Trainer inspects and calls them); torchbay-fsdp's strategy does the work
(:mod:`torchbay_fsdp.accelerate_files`). ``merge_fsdp_weights`` consolidates a torchbay FSDP checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchbay.errors import ConfigError
from torchbay.plugin import remove_own_checkpoint
from torchbay_fsdp.accelerate_plugin import FullyShardedDataParallelPlugin
from torchbay_fsdp.merge import merge_weights
from torchbay_fsdp.strategy import FSDPStrategy

__all__ = ["FullyShardedDataParallelPlugin", "load_fsdp_model", "load_fsdp_optimizer", "merge_fsdp_weights",
           "save_fsdp_model", "save_fsdp_optimizer"]


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False) -> list[str]:
    """Write the full weights of a torchbay FSDP checkpoint as safetensors (``torchbay merge-weights``)."""
    if not safe_serialization:
        raise ConfigError("merge_fsdp_weights(safe_serialization=False): torchbay writes safetensors only")
    written = merge_weights(checkpoint_dir, output_path)
    if remove_checkpoint_dir:  # only the files the checkpoint's manifest lists: never a user's file
        remove_own_checkpoint(Path(checkpoint_dir), "merge_fsdp_weights(remove_checkpoint_dir=True)")
    return written


# -- Accelerate's FSDP checkpoint functions (transformers' Trainer calls them; their signatures are Accelerate's) --
def _strategy_of(accelerator: Any, what: str) -> Any:
    strategy = getattr(accelerator, "strategy", None)
    if not isinstance(strategy, FSDPStrategy):
        raise ConfigError(f"{what}: the accelerator runs strategy '{getattr(strategy, 'name', strategy)}', not fsdp; "
                          f"select strategy: fsdp (Accelerator(fsdp_plugin=...), --strategy fsdp), or checkpoint with "
                          f"accelerator.save_state/load_state")
    return strategy


def _plugin_of(fsdp_plugin: Any, strategy: Any) -> Any:
    plugin = fsdp_plugin if fsdp_plugin is not None else strategy.accelerate_state_objects()["fsdp_plugin"]
    if getattr(plugin, "state_dict_type", None) is None:
        plugin.set_state_dict_type()
    return plugin


def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0, adapter_only=False, use_dcp=True):
    """Write ``model``'s state as Accelerate does: ``pytorch_model_fsdp[_i].bin`` (FULL_STATE_DICT, rank 0)
    or the DCP folder ``pytorch_model_fsdp_<i>/`` (SHARDED_STATE_DICT, every rank). Every rank calls it."""
    strategy = _strategy_of(accelerator, "save_fsdp_model")
    strategy.save_accelerate_model(_plugin_of(fsdp_plugin, strategy), model, output_dir, model_index,
                                   adapter_only=adapter_only, use_dcp=use_dcp)


def load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index=0, adapter_only=False, use_dcp=True):
    """Read what :func:`save_fsdp_model` (torchbay's or Accelerate's) wrote into the sharded ``model``;
    returns torch's missing/unexpected keys. Every rank calls it."""
    strategy = _strategy_of(accelerator, "load_fsdp_model")
    return strategy.load_accelerate_model(_plugin_of(fsdp_plugin, strategy), model, input_dir, model_index,
                                          adapter_only=adapter_only, use_dcp=use_dcp)


def save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, use_dcp=True):
    """Write the optimizer's state as Accelerate does: ``optimizer[_i].bin`` (FULL_STATE_DICT, rank 0) or the
    DCP folder ``optimizer_<i>/`` (SHARDED_STATE_DICT). Every rank calls it."""
    strategy = _strategy_of(accelerator, "save_fsdp_optimizer")
    strategy.save_accelerate_optimizer(_plugin_of(fsdp_plugin, strategy), optimizer, model, output_dir,
                                       optimizer_index, use_dcp=use_dcp)


def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0, adapter_only=False,
                        use_dcp=True):
    """Read what :func:`save_fsdp_optimizer` (torchbay's or Accelerate's) wrote. Every rank calls it."""
    strategy = _strategy_of(accelerator, "load_fsdp_optimizer")
    strategy.load_accelerate_optimizer(_plugin_of(fsdp_plugin, strategy), optimizer, model, input_dir,
                                       optimizer_index, use_dcp=use_dcp)
