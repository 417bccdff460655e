"""``BnbQuantizationConfig``: Accelerate's settings for bitsandbytes 8-bit and 4-bit loading.

torchbay does not quantize models (``load_and_quantize_model`` stays refused: quantized loading
belongs to bitsandbytes and transformers), but the settings object is served, checked as
Accelerate checks it, so that code building one (or reading one a script was given) works: a
wrong value raises a :class:`~torchbay.errors.ConfigError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from torchbay.compat.library_names import CustomDtype
from torchbay.errors import ConfigError

#: the short dtype names the fields accept, as Accelerate's
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_QUANT_TYPES = ("fp4", "nf4")


def _problem(message: str) -> ConfigError:
    return ConfigError(message, header="invalid BnbQuantizationConfig")


def _dtype(field_name: str, value: Any) -> torch.dtype:
    """``value`` as a torch dtype: one already, or one of the short names of :data:`_DTYPES`."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise _problem(f"{field_name}={value!r}: use a torch.dtype or one of {sorted(_DTYPES)}")


@dataclass
class BnbQuantizationConfig:
    """Which bitsandbytes quantization to load a model with (exactly one of ``load_in_8bit`` and
    ``load_in_4bit``) and how; ``torch_dtype`` is the dtype of the layers left unquantized
    (default: float16 for 8-bit, the compute dtype for 4-bit)."""

    load_in_8bit: bool = False
    llm_int8_threshold: float = 6.0
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: Any = "fp16"
    torch_dtype: Optional[torch.dtype] = None
    skip_modules: Optional[list[str]] = None
    keep_in_fp32_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            if not isinstance(getattr(self, name), bool):
                raise _problem(f"{name}={getattr(self, name)!r}: it must be True or False")
        if self.load_in_8bit == self.load_in_4bit:
            raise _problem(f"load_in_8bit={self.load_in_8bit} and load_in_4bit={self.load_in_4bit}: set exactly "
                           f"one of them to True")
        if not isinstance(self.llm_int8_threshold, (int, float)):
            raise _problem(f"llm_int8_threshold={self.llm_int8_threshold!r}: it must be a number")
        if self.bnb_4bit_quant_type not in _QUANT_TYPES:
            raise _problem(f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}: choose one of {list(_QUANT_TYPES)}")
        self.bnb_4bit_compute_dtype = _dtype("bnb_4bit_compute_dtype", self.bnb_4bit_compute_dtype)
        for name in ("skip_modules", "keep_in_fp32_modules"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), list):
                raise _problem(f"{name}={getattr(self, name)!r}: it must be a list of module names")
        if self.load_in_4bit and self.llm_int8_threshold != 6.0:
            warnings.warn("BnbQuantizationConfig: llm_int8_threshold applies to 8-bit loading only; it is ignored "
                          "with load_in_4bit=True", stacklevel=3)
        if self.torch_dtype is None:
            self.torch_dtype = torch.float16 if self.load_in_8bit else self.bnb_4bit_compute_dtype
        self.torch_dtype = _dtype("torch_dtype", self.torch_dtype)
        #: what the quantized layers hold
        self.target_dtype = torch.int8 if self.load_in_8bit else CustomDtype.INT4


__all__ = ["BnbQuantizationConfig"]
