"""Accelerate's DeepSpeed names, answered by torchbay-deepspeed (re-exported lazily by ``torchbay.utils``).

- :class:`HfDeepSpeedConfig`: a DeepSpeed config (a JSON path, a dict, JSON text or base64 JSON) that can be
  queried (``get_value("zero_optimization.stage")``, ``is_zero3()``, ``is_offload()``...). transformers subclasses
  it (``HfTrainerDeepSpeedConfig``) and fills its ``"auto"`` values from ``TrainingArguments``.
- :class:`DeepSpeedPlugin`: Accelerate's settings object. With ``hf_ds_config`` the DeepSpeed config is that one
  (the plugin's fields fill its ``"auto"`` values, and the config's values fill the unset fields); without, a
  config is made from the fields. ``Accelerator(deepspeed_plugin=...)`` selects strategy ``deepspeed``
  (:meth:`DeepSpeedPlugin.to_config`), ``accelerator.state.deepspeed_plugin`` is the plugin, and the engine is
  built at ``prepare`` from ``plugin.deepspeed_config`` *as it is then* (transformers' Trainer completes it between
  the two), its remaining ``"auto"`` values filled in place as Accelerate fills them.
- ``DummyOptim``/``DummyScheduler`` (objects.py) stand for the config's optimizer and scheduler;
  :class:`DeepSpeedSchedulerWrapper` is what ``prepare`` returns for DeepSpeed's own scheduler.

Nothing here imports deepspeed.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from torchbay.errors import ConfigError
from torchbay_deepspeed.objects import DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler  # noqa: F401

#: DeepSpeedPlugin field -> where it lives in the DeepSpeed config (Accelerate's mapping)
PLUGIN_FIELDS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


class HfDeepSpeedConfig:
    """A DeepSpeed config to query: ``config`` is the dict itself (changes made through it are seen by all)."""

    def __init__(self, config_file_or_dict: Any):
        self.config = self._read(config_file_or_dict)
        self.set_stage_and_offload()

    @staticmethod
    def _read(source: Any) -> dict:
        if isinstance(source, dict):
            return copy.deepcopy(source)  # the caller's dict stays reusable ("auto" values intact)
        if not isinstance(source, (str, os.PathLike)):
            raise ConfigError(f"HfDeepSpeedConfig takes a DeepSpeed JSON path, a dict, JSON text or base64 JSON, "
                              f"not {type(source).__name__}")
        text = os.fspath(source)
        if os.path.exists(text):
            with open(text, encoding="utf-8") as handle:
                try:
                    data = json.load(handle)
                except ValueError as exc:
                    raise ConfigError(f"the DeepSpeed config {text} is not valid JSON: {exc}") from None
        else:
            try:
                data = json.loads(text)
            except ValueError:
                try:
                    data = json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
                except (ValueError, UnicodeDecodeError, binascii.Error):
                    raise ConfigError(f"HfDeepSpeedConfig: {text[:200]!r} is neither an existing DeepSpeed JSON "
                                      f"file, nor JSON text, nor base64-encoded JSON; give the path of the config "
                                      f"or the config as a dict") from None
        if not isinstance(data, dict):
            raise ConfigError("a DeepSpeed config must be a JSON object (a dict)")
        return data

    def set_stage_and_offload(self) -> None:
        """Read the ZeRO stage (-1 when unset) and whether anything is offloaded (ZeRO 2/3 only) again."""
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        self._offload = (self.is_zero2() or self.is_zero3()) and bool(devices & {"cpu", "nvme"})

    def find_config_node(self, ds_key_long: str) -> tuple[Optional[dict], str]:
        """``(the dict holding the last part of the dotted key, that last part)``; ``(None, last)`` when a parent
        section is missing."""
        *parents, key = ds_key_long.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Remove a key or section; a missing one is an error only with ``must_exist``."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ConfigError(f"the DeepSpeed config has no '{ds_key_long}' to delete")
            return
        del node[key]

    def is_true(self, ds_key_long: str) -> bool:
        """True only when the value is set and true (unset is False)."""
        value = self.get_value(ds_key_long)
        return value is not None and bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        """True only when the value is set and false (unset is False too)."""
        value = self.get_value(ds_key_long)
        return value is not None and not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeed settings object (``Accelerator(deepspeed_plugin=...)``).

    ``hf_ds_config``: a path to a DeepSpeed JSON, the config as a dict, or an :class:`HfDeepSpeedConfig`
    (transformers' subclass included, kept as the same object). Unset fields take Accelerate's defaults when
    there is no config (ZeRO 2, nothing offloaded, ``"auto"`` accumulation and clipping); with a config the
    config decides, a field only filling an ``"auto"`` value there. ``deepspeed_config`` is the config's dict.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Optional[int] = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Optional[str] = None
    offload_param_device: Optional[str] = None
    offload_optimizer_nvme_path: Optional[str] = None
    offload_param_nvme_path: Optional[str] = None
    zero3_init_flag: Optional[bool] = None
    zero3_save_16bit_model: Optional[bool] = None
    transformer_moe_cls_names: Optional[str] = None
    enable_msamp: Optional[bool] = None
    msamp_opt_level: Optional[str] = None

    def __post_init__(self):
        refused = [n for n in ("transformer_moe_cls_names", "enable_msamp") if getattr(self, n)]
        if refused:
            raise ConfigError([f"DeepSpeedPlugin({n}=...) is not supported by torchbay-deepspeed (MS-AMP is the "
                               f"torchbay-fp8-msamp plugin; MoE leaf modules: set them on the model with "
                               f"deepspeed.utils.set_z3_leaf_modules before prepare)" for n in refused])
        defaults = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_stage": 2,
                    "offload_optimizer_device": "none", "offload_param_device": "none",
                    "offload_optimizer_nvme_path": "none", "offload_param_nvme_path": "none",
                    "zero3_save_16bit_model": False}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        self.enable_msamp = bool(self.enable_msamp)
        self.msamp_opt_level = self.msamp_opt_level or "O1"
        if isinstance(self.hf_ds_config, str) and self.hf_ds_config == "none":
            self.hf_ds_config = None
        if self.hf_ds_config is not None:
            if not isinstance(self.hf_ds_config, HfDeepSpeedConfig):
                self.hf_ds_config = HfDeepSpeedConfig(self.hf_ds_config)
            config = self.hf_ds_config.config
            config.setdefault("gradient_accumulation_steps", 1)
            if "zero_optimization" not in config:
                raise ConfigError("the DeepSpeed config of DeepSpeedPlugin(hf_ds_config=...) has no "
                                  "'zero_optimization' section; add one (e.g. {\"stage\": 2})")
            values = {PLUGIN_FIELDS[name]: getattr(self, name) for name in PLUGIN_FIELDS}
            for key in values:
                self.fill_match(key, must_match=False, **values)
            self.hf_ds_config.set_stage_and_offload()
            for name, key in PLUGIN_FIELDS.items():  # the config's own values win over the fields
                value = self.hf_ds_config.get_value(key)
                if value is not None and value != "auto":
                    setattr(self, name, value)
        else:
            zero = {"stage": self.zero_stage,
                    "offload_optimizer": {"device": self.offload_optimizer_device,
                                          "nvme_path": self.offload_optimizer_nvme_path
                                          if self.offload_optimizer_device == "nvme" else None},
                    "offload_param": {"device": self.offload_param_device,
                                      "nvme_path": self.offload_param_nvme_path
                                      if self.offload_param_device == "nvme" else None},
                    "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model}
            config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                      "gradient_accumulation_steps": self.gradient_accumulation_steps, "zero_optimization": zero}
            if self.gradient_clipping:  # "auto" included: prepare fills it (Accelerate: 1.0, Trainer: max_grad_norm)
                config["gradient_clipping"] = self.gradient_clipping
            self.hf_ds_config = HfDeepSpeedConfig(config)
        self.deepspeed_config = self.hf_ds_config.config
        self.deepspeed_config.setdefault("steps_per_print", 2**31 - 1)  # torchbay users log themselves
        if self.zero3_init_flag is None:
            self.zero3_init_flag = self.hf_ds_config.is_zero3()
        if self.zero3_init_flag and not self.hf_ds_config.is_zero3():
            self.zero3_init_flag = False  # Accelerate warns and drops it too: zero.Init is a ZeRO-3 feature
        self._selected = False

    # -- Accelerate's methods on the config ---------------------------------------------------------
    def fill_match(self, ds_key_long: str, mismatches: Optional[list] = None, must_match: bool = True,
                   **kwargs: Any) -> None:
        """Put ``kwargs[ds_key_long]`` where the config says ``"auto"``; with ``must_match``, list a differing
        set value in ``mismatches``. An ``"auto"`` nobody gives a value for is an error."""
        mismatches = [] if mismatches is None else mismatches
        node, key = self.hf_ds_config.find_config_node(ds_key_long)
        if node is None:
            return
        if node.get(key) == "auto":
            if ds_key_long not in kwargs:
                raise ConfigError(f"DeepSpeed '{ds_key_long}' is \"auto\" and nothing fills it here; write a value "
                                  f"in the DeepSpeed config")
            node[key] = kwargs[ds_key_long]
            return
        if must_match and node.get(key) is not None and ds_key_long in kwargs and node[key] != kwargs[ds_key_long]:
            mismatches.append(f"- ds {ds_key_long}={node[key]} vs arg {ds_key_long}={kwargs[ds_key_long]}")

    def is_auto(self, ds_key_long: str) -> bool:
        return self.hf_ds_config.get_value(ds_key_long) == "auto"

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return self.hf_ds_config.get_value(ds_key_long, default)

    def deepspeed_config_process(self, prefix: str = "", mismatches: Optional[list] = None,
                                 config: Optional[dict] = None, must_match: bool = True, **kwargs: Any) -> None:
        """:meth:`fill_match` on every leaf of the config; mismatches are one error listing them all."""
        mismatches = [] if mismatches is None else mismatches
        for key, value in (self.deepspeed_config if config is None else config).items():
            if isinstance(value, dict):
                self.deepspeed_config_process(prefix + key + ".", mismatches, value, must_match, **kwargs)
            else:
                self.fill_match(prefix + key, mismatches, must_match=must_match, **kwargs)
        if mismatches and not prefix:
            raise ConfigError(["these DeepSpeed config values differ from the arguments; write \"auto\" there"]
                              + mismatches)

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Write ``mixed_precision`` (no/fp16/bf16) into the config's fp16/bf16 sections."""
        if mixed_precision == "fp8":
            raise ConfigError("mixed_precision fp8 does not run under strategy deepspeed; use bf16 or fp16")
        config = self.deepspeed_config
        if mixed_precision in ("fp16", "bf16"):
            other = "bf16" if mixed_precision == "fp16" else "fp16"
            if str(config.get(other, {}).get("enabled", False)).lower() == "true":
                raise ConfigError(f"mixed_precision is {mixed_precision} but the DeepSpeed config enables {other}; "
                                  f"change one of them")
            config.setdefault(mixed_precision, {"enabled": True, **({"auto_cast": True}
                                                                     if mixed_precision == "fp16" else {})})
        for name in ("fp16", "bf16"):
            config.setdefault(name, {"enabled": False})
        values = {"fp16.enabled": mixed_precision == "fp16", "bf16.enabled": mixed_precision == "bf16"}
        self.fill_match("fp16.enabled", must_match=False, **values)
        self.fill_match("bf16.enabled", must_match=False, **values)

    def set_deepspeed_weakref(self) -> None:
        """Give transformers the config (its ``is_deepspeed_zero3_enabled()`` and ``zero.Init`` in
        ``from_pretrained`` read it), with ``"auto"`` batch values made concrete as Accelerate does."""
        from transformers.integrations import HfDeepSpeedConfig as TransformersConfig
        from transformers.integrations import unset_hf_deepspeed_config

        config = copy.deepcopy(self.deepspeed_config)
        for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
            if config.get(key, "auto") == "auto":
                config[key] = 1
        if config.get("train_batch_size") == "auto":
            del config["train_batch_size"]
        unset_hf_deepspeed_config()
        self.dschf = TransformersConfig(config)  # transformers keeps a weak reference: hold it here

    def is_zero3_init_enabled(self) -> bool:
        return bool(self.zero3_init_flag)

    @contextlib.contextmanager
    def zero3_init_context_manager(self, enable: bool = False):
        """Models built inside are (``enable``) or are not built under ``deepspeed.zero.Init`` by transformers."""
        old = self.zero3_init_flag
        if old == enable:
            yield
            return
        self.zero3_init_flag = enable
        self.dschf = None
        self.set_deepspeed_weakref()
        try:
            yield
        finally:
            self.zero3_init_flag = old
            self.dschf = None
            self.set_deepspeed_weakref()

    def set_moe_leaf_modules(self, model: Any) -> None:
        """Nothing to do: MoE leaf modules are refused in the constructor."""

    def _set_selected(self, value: bool) -> None:
        self._selected = bool(value)

    @property
    def selected(self) -> bool:
        return self._selected

    @selected.setter
    def selected(self, value: bool) -> None:
        raise ConfigError("DeepSpeedPlugin.selected is set by the Accelerator; torchbay runs one DeepSpeed plugin "
                          "per Accelerator")

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this the run's plugin (done by the Accelerator): transformers, when installed, is given its config."""
        if not _from_accelerator_state:
            raise ConfigError("a DeepSpeedPlugin is selected by passing it to Accelerator(deepspeed_plugin=...)")
        import importlib.util

        if importlib.util.find_spec("transformers") is not None:
            self.set_deepspeed_weakref()
        self._set_selected(True)

    # -- torchbay --------------------------------------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """torchbay settings: strategy ``deepspeed``, the config as ``deepspeed.config`` (checked before the run;
        the engine is built from ``deepspeed_config`` as it is at ``prepare``) and its integer accumulation."""
        out: dict[str, Any] = {"strategy": "deepspeed", "deepspeed.config": copy.deepcopy(self.deepspeed_config)}
        out["deepspeed.config"].pop("steps_per_print", None)
        ga = self.deepspeed_config.get("gradient_accumulation_steps")
        if isinstance(ga, int) and not isinstance(ga, bool):
            out["gradient_accumulation_steps"] = ga
        return out
