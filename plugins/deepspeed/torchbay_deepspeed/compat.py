"""Accelerate's DeepSpeed names, answered by torchbay-deepspeed (re-exported lazily by ``torchbay.utils``).

``DeepSpeedPlugin(...)`` takes Accelerate's fields and gives them to the ``deepspeed`` config
section (``Accelerator(deepspeed_plugin=...)``); ``DummyOptim``/``DummyScheduler`` are the
plugin's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torchbay.errors import ConfigError
from torchbay_deepspeed.objects import DummyOptim, DummyScheduler  # noqa: F401 (re-exported)


@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeed settings object; ``to_config()`` gives torchbay's ``deepspeed`` section."""

    hf_ds_config: Any = None  # a path to a DeepSpeed JSON, or the config as a dict
    gradient_accumulation_steps: Optional[int] = None
    gradient_clipping: Optional[float] = None
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

    def to_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": "deepspeed"}
        if isinstance(self.hf_ds_config, str):
            out["deepspeed.deepspeed_config_file"] = self.hf_ds_config
        elif isinstance(self.hf_ds_config, dict):
            out["deepspeed.config"] = dict(self.hf_ds_config)
        elif self.hf_ds_config is not None:
            raise ConfigError("DeepSpeedPlugin(hf_ds_config=...) takes a JSON path or a dict")
        if self.gradient_accumulation_steps is not None:
            out["gradient_accumulation_steps"] = int(self.gradient_accumulation_steps)
        for name in ("gradient_clipping", "zero_stage", "offload_optimizer_device", "offload_param_device",
                     "offload_optimizer_nvme_path", "offload_param_nvme_path", "zero3_save_16bit_model"):
            if getattr(self, name) is not None:
                out[f"deepspeed.{name}"] = getattr(self, name)
        if self.zero3_init_flag is not None:
            out["deepspeed.zero3_init"] = bool(self.zero3_init_flag)
        refused = [n for n in ("transformer_moe_cls_names", "enable_msamp", "msamp_opt_level") if getattr(self, n)]
        if refused:
            raise ConfigError([f"DeepSpeedPlugin({n}=...) is not supported by torchbay-deepspeed (MS-AMP is the "
                               f"torchbay-fp8-msamp plugin)" for n in refused])
        return out
