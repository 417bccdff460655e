"""The conformance check of big-model placement: device capacity and a dispatched forward."""

import tempfile
from typing import Any

import torch
from torch import nn

from torchbay.big_modeling.device_map import accelerator_class
from torchbay.big_modeling.infer import infer_auto_device_map
from torchbay.big_modeling.modeling import dispatch_model
from torchbay.registry import manager as plugins
from torchbay.testing._conformance_base import ConformanceSkip, _device_class, _fail, _require_available


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _check_capacity(cls) -> dict[int, int]:
    capacity = cls.memory_capacity()
    count = cls.device_count()
    if not isinstance(capacity, dict) or sorted(capacity) != list(range(count)):
        _fail(f"memory_capacity() must return {{index: (free, total)}} for the indexes 0..{count - 1} "
              f"(device_count() is {count}); got {capacity!r}")
    for index, info in capacity.items():
        if not (isinstance(info, tuple) and len(info) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                    for v in info)):
            _fail(f"memory_capacity()[{index}] must be (free_bytes, total_bytes) as ints, got {info!r}")
        if not 0 <= info[0] <= info[1] or info[1] <= 0:
            _fail(f"memory_capacity()[{index}] = {info}: need 0 <= free <= total and total > 0")
    budget = cls.placement_budget()
    if sorted(budget) != sorted(capacity):
        _fail(f"placement_budget() must give one value per index of memory_capacity(); got {budget!r}")
    for index, value in budget.items():
        if not isinstance(value, int) or not 0 <= value <= capacity[index][0]:
            _fail(f"placement_budget()[{index}] = {value!r}: it must be bytes between 0 and the free memory "
                  f"{capacity[index][0]} (device_map='auto' fills each device up to it)")
    return budget


def check_placement(name: str, pm=None, **_: Any) -> str:
    """memory_capacity / placement_budget per index; device_map="auto" places a model on this
    device, and a model split between it and an offload runs and gives the eager output."""
    cls = _device_class(name, pm)
    _require_available(cls)
    budget = _check_capacity(cls)
    previous = plugins.peek_plugin_manager()
    if pm is not None:
        plugins.reset_plugin_manager(pm)
    try:
        is_cpu = cls.torch_type() == "cpu"
        chosen = accelerator_class()
        if not is_cpu and chosen is not cls:
            raise ConformanceSkip(f"big-model placement here uses device '{getattr(chosen, 'name', None)}' (higher "
                                  f"priority), not '{name}'")
        torch.manual_seed(0)
        eager = _Tiny()
        x = torch.randn(4, 16)
        want = eager(x)
        # the cpu under check gets the cpu's own budget alone: where an accelerator is also present,
        # device_map="auto" would rightly prefer it
        max_memory = {"cpu": budget[0]} if is_cpu else None
        with torch.device("meta"):
            auto_map = infer_auto_device_map(_Tiny(), max_memory=max_memory)
        expected = {"": "cpu" if is_cpu else 0}
        if auto_map != expected:
            _fail(f"infer_auto_device_map() put a tiny model at {auto_map}, expected {expected}: check "
                  f"placement_budget() (it gave {budget})")
        model = _Tiny()
        model.load_state_dict(eager.state_dict())
        with tempfile.TemporaryDirectory() as folder:
            split = {"first": "cpu", "second": "disk"} if is_cpu else {"first": 0, "second": "cpu"}
            dispatch_model(model, split, offload_dir=folder)
            got = model(x)
            if got.device != x.device:
                _fail(f"the dispatched model returned its output on {got.device}, not on the input's {x.device}")
            if not torch.allclose(got, want, atol=1e-3, rtol=1e-3):
                _fail(f"a model split as {split} gives outputs that differ from the eager model by "
                      f"{(got - want).abs().max().item():.3g}")
    finally:
        plugins.reset_plugin_manager(previous)
    return f"budget {budget}; auto map {auto_map}; split {split} equals eager"
