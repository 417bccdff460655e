"""BnbQuantizationConfig, Accelerate's bitsandbytes settings object (issue 36): served and checked as
Accelerate checks it, while quantized loading itself stays refused. Where the real Accelerate is
installed, the same settings are given to its class and the outcomes compared."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from torchbay import utils
from torchbay.compat.library_names import CustomDtype
from torchbay.errors import ConfigError, UnsupportedAPIError

HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None

REFUSED = [
    ({"load_in_8bit": True, "load_in_4bit": True}, "set exactly one"),
    ({}, "set exactly one"),
    ({"load_in_8bit": 1}, "load_in_8bit=1"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int3"}, "bnb_4bit_quant_type='int3'"),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "fp64"}, "bnb_4bit_compute_dtype='fp64'"),
    ({"load_in_8bit": True, "torch_dtype": 16}, "torch_dtype=16"),
    ({"load_in_8bit": True, "skip_modules": "lm_head"}, "skip_modules='lm_head'"),
    ({"load_in_8bit": True, "llm_int8_threshold": "6"}, "llm_int8_threshold='6'"),
]


@pytest.mark.parametrize("kwargs, says", REFUSED)
def test_wrong_settings_raise_a_value_error_naming_the_field(kwargs, says):
    with pytest.raises(ConfigError, match="invalid BnbQuantizationConfig") as info:
        utils.BnbQuantizationConfig(**kwargs)
    assert isinstance(info.value, ValueError) and says in str(info.value)
    if HAVE_ACCELERATE:
        from accelerate.utils.dataclasses import BnbQuantizationConfig

        with pytest.raises(ValueError):
            BnbQuantizationConfig(**kwargs)


def test_defaults_follow_the_quantization():
    eight = utils.BnbQuantizationConfig(load_in_8bit=True)
    assert eight.torch_dtype is torch.float16 and eight.target_dtype is torch.int8
    four = utils.BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16", skip_modules=["lm_head"])
    assert four.bnb_4bit_compute_dtype is torch.bfloat16 and four.torch_dtype is torch.bfloat16
    assert four.target_dtype is CustomDtype.INT4
    assert utils.BnbQuantizationConfig(load_in_8bit=True, torch_dtype="fp32").torch_dtype is torch.float32
    with pytest.warns(UserWarning, match="8-bit loading only"):
        utils.BnbQuantizationConfig(load_in_4bit=True, llm_int8_threshold=3.0)


def test_quantized_loading_stays_refused():
    with pytest.raises(UnsupportedAPIError, match="quantization libraries"):
        utils.load_and_quantize_model  # noqa: B018 (the attribute access is the refusal)


@pytest.mark.skipif(not HAVE_ACCELERATE, reason="compares with the installed Accelerate (a dev dependency)")
def test_the_same_fields_and_outcomes_as_accelerates():
    import dataclasses

    from accelerate.utils.dataclasses import BnbQuantizationConfig

    assert [f.name for f in dataclasses.fields(utils.BnbQuantizationConfig)] == \
        [f.name for f in dataclasses.fields(BnbQuantizationConfig)]
    for kwargs in ({"load_in_8bit": True}, {"load_in_4bit": True, "bnb_4bit_compute_dtype": torch.float32},
                   {"load_in_4bit": True, "torch_dtype": "fp16", "bnb_4bit_quant_type": "nf4"}):
        ours, theirs = utils.BnbQuantizationConfig(**kwargs), BnbQuantizationConfig(**kwargs)
        for name in ("torch_dtype", "bnb_4bit_compute_dtype"):
            assert getattr(ours, name) == getattr(theirs, name), (kwargs, name)
        assert str(ours.target_dtype) == str(theirs.target_dtype)
