"""Accelerator behaviours as Accelerate's users see them (issue 36): refusing to train a quantized model
offloaded to the cpu or disk."""

from __future__ import annotations

import pytest
import torch

import torchbay
from torchbay.errors import ConfigError


@pytest.fixture
def accelerator():
    return torchbay.Accelerator(cpu=True)  # (the autouse clean_torchbay_env fixture resets the state)


@pytest.mark.parametrize("flag", ["is_loaded_in_8bit", "is_loaded_in_4bit"])
@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_a_quantized_model_offloaded_to_cpu_or_disk_is_refused_with_a_value_error(accelerator, flag, where):
    model = torch.nn.Linear(2, 2)
    setattr(model, flag, True)
    model.hf_device_map = {"": where}
    with pytest.raises(ConfigError, match="CPU or disk offload") as info:
        accelerator.prepare_model(model)
    assert isinstance(info.value, ValueError) and "hf_device_map" in str(info.value)


def test_a_quantized_model_on_the_device_or_a_plain_offloaded_one_is_prepared(accelerator):
    quantized = torch.nn.Linear(2, 2)
    quantized.is_loaded_in_8bit, quantized.hf_device_map = True, {"": 0}
    accelerator.prepare_model(quantized)
    plain = torch.nn.Linear(2, 2)
    plain.hf_device_map = {"": "cpu"}
    accelerator.prepare_model(plain)


def test_after_a_state_reset_the_accelerators_process_queries_say_so(accelerator):
    from torchbay.process.state import StateResetError

    assert accelerator.num_processes == 1
    with pytest.raises(AttributeError, match="no attribute 'someotherthing'"):
        accelerator.state.someotherthing  # noqa: B018
    accelerator.state._reset_state()
    for name in ("num_processes", "process_index", "local_process_index"):
        with pytest.raises(StateResetError, match=r"_reset_state\(\)"):
            getattr(accelerator, name)
