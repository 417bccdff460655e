"""MS-AMP's precision without MS-AMP: the strategies it refuses (read from the config tree)
and the one-model-with-its-optimizer rule of its prepare step (checked before msamp is imported)."""

import json
from types import SimpleNamespace

import pytest
import torch

from torchbay.errors import TorchbayError
from torchbay_fp8 import FP8Config
from torchbay_fp8_msamp.precision import MSAMPFP8Precision, strategy_problems


def test_msamp_refuses_zero3_and_fsdp_from_the_config(tmp_path):
    zero3 = SimpleNamespace(strategy="deepspeed", deepspeed=SimpleNamespace(zero_stage=3))
    assert "does not support DeepSpeed ZeRO-3" in strategy_problems(zero3)[0]
    in_json = SimpleNamespace(strategy="deepspeed", deepspeed={"config": {"zero_optimization": {"stage": 3}}})
    assert strategy_problems(in_json)
    assert strategy_problems(SimpleNamespace(strategy="deepspeed", deepspeed=SimpleNamespace(zero_stage=2))) == []
    assert strategy_problems(SimpleNamespace(strategy="deepspeed")) == []  # no section: nothing to read
    assert "strategy: fsdp" in strategy_problems(SimpleNamespace(strategy="fsdp"))[0]
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    in_file = SimpleNamespace(strategy="deepspeed", deepspeed=SimpleNamespace(zero_stage=None, config={},
                                                                              deepspeed_config_file=str(ds_json)))
    assert strategy_problems(in_file)
    assert strategy_problems(SimpleNamespace(strategy="ddp")) == []


def test_msamp_prepare_takes_one_model_with_its_optimizer():
    context = SimpleNamespace(config=SimpleNamespace(fp8=FP8Config()), device_backend=None)
    precision = MSAMPFP8Precision(context)
    model = torch.nn.Linear(16, 16)
    assert precision.prepare([], []) == ([], []) and not precision.initialized  # e.g. data loaders only
    with pytest.raises(TorchbayError, match="exactly one model and one optimizer"):
        precision.prepare([model, torch.nn.Linear(16, 16)], [torch.optim.SGD(model.parameters(), lr=0.1)])
    with pytest.raises(TorchbayError, match=r"1 model\(s\) and 0 optimizer\(s\)"):
        precision.prepare([model], [])
