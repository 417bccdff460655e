"""MS-AMP's precision without MS-AMP: the strategies it refuses and the
one-model-with-its-optimizer rule of its prepare step (checked before msamp is imported)."""

from types import SimpleNamespace

import pytest
import torch
from torchbay_fp8 import FP8Config
from torchbay_fp8_msamp.precision import MSAMPFP8Precision, strategy_problems

from torchbay.errors import TorchbayError


def test_msamp_refuses_deepspeed_at_any_zero_stage_and_fsdp():
    for stage in (0, 2, 3):
        config = SimpleNamespace(strategy="deepspeed", deepspeed=SimpleNamespace(zero_stage=stage))
        (problem,) = strategy_problems(config)
        assert "fp8 engine 'msamp' does not run under strategy: deepspeed" in problem and "ZeRO-3" in problem
        assert "use strategy: ddp" in problem
    assert "does not run under strategy: fsdp" in strategy_problems(SimpleNamespace(strategy="fsdp"))[0]
    for fine in ("ddp", "single", "auto"):
        assert strategy_problems(SimpleNamespace(strategy=fine)) == []


def test_msamp_prepare_takes_one_model_with_its_optimizer():
    context = SimpleNamespace(config=SimpleNamespace(fp8=FP8Config()), device_backend=None)
    precision = MSAMPFP8Precision(context)
    model = torch.nn.Linear(16, 16)
    assert precision.prepare([], []) == ([], []) and not precision.initialized  # e.g. data loaders only
    with pytest.raises(TorchbayError, match="exactly one model and one optimizer"):
        precision.prepare([model, torch.nn.Linear(16, 16)], [torch.optim.SGD(model.parameters(), lr=0.1)])
    with pytest.raises(TorchbayError, match=r"1 model\(s\) and 0 optimizer\(s\)"):
        precision.prepare([model], [])
