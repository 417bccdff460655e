"""torchbay-fp8's shared pieces, without an engine: which Linears are converted, the
small-layer rule and the engine-options check (the engines' own tests are in plugins/fp8/tests/test_fp8.py)."""

import torch
from torchbay_fp8 import FP8Config
from torchbay_fp8.linears import SMALL_LAYER_HARMONIC, harmonic_size, plan_linears, small_layers
from torchbay_fp8.precision import option_problems


def test_linear_plan_filters_by_name_shape_and_position():
    model = torch.nn.ModuleDict({"embed": torch.nn.Linear(16, 64), "attn": torch.nn.Linear(64, 64),
                                 "odd": torch.nn.Linear(64, 50), "mlp": torch.nn.Linear(64, 64),
                                 "gate": torch.nn.Linear(64, 64), "head": torch.nn.Linear(64, 64)})
    plan = plan_linears(model, FP8Config(exclude=["gate"]))
    assert plan.convert == ["attn", "mlp"]
    assert "multiples of 16" in plan.skipped["odd"] and "fp8.exclude" in plan.skipped["gate"]
    assert "first" in plan.skipped["embed"] and "last" in plan.skipped["head"]
    plan = plan_linears(model, FP8Config(keep_first_and_last=False, include=["^(embed|head|mlp)$"]))
    assert plan.convert == ["embed", "mlp", "head"] and "fp8.include" in plan.skipped["attn"]
    attention = torch.nn.MultiheadAttention(64, 4)  # its out_proj is a Linear subclass: left alone
    assert plan_linears(attention, FP8Config(keep_first_and_last=False)).convert == []


def test_small_layer_rule():
    assert small_layers({"a": (1024, 1024), "b": (2048, 2048), "c": (1024, 4096), "d": (8192, 8192)}) == ["a", "c"]
    assert harmonic_size(2048, 2048) >= SMALL_LAYER_HARMONIC > harmonic_size(1024, 4096)


def test_engine_options_are_checked_by_name_type_and_value():
    allowed = {"flag": bool, "size": (int, float), "level": {"O1", "O2"}}
    assert option_problems("mine", {"flag": True, "size": 2, "level": "O1"}, allowed) == []
    problems = option_problems("mine", {"flg": True, "size": True, "level": "O3"}, allowed)
    assert "fp8.engine_options.flg is not an option of fp8 engine 'mine'; did you mean 'flag'?" in problems[0]
    assert "fp8.engine_options.size = True must be int or float" in problems[1]  # a bool is not a number here
    assert ("fp8.engine_options.level = 'O3' is not accepted by fp8 engine 'mine'; "
            "use one of ['O1', 'O2']") in problems[2]
