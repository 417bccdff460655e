"""How big-model loading and dispatch go through big_modeling/ (issue 37 item 6).

``dispatch_model`` checks the map and hands the rest to ``dispatch.py`` once; nothing it calls comes back
into the module that called it. A checkpoint that loads in under two seconds makes no progress bar
(the first tqdm bar of a process starts tqdm's monitor thread, which the load would wait for).
"""

import os
import sys
import threading

import pytest
import torch
from torch import nn

import torchbay
import torchbay.big_modeling.modeling as modeling
from torchbay.big_modeling import loading

PKG = os.path.dirname(modeling.__file__)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(4))
        self.head = nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * self.scale
        return self.head(x)


def calls_between_modules(fn) -> set[tuple[str, str, str]]:
    """``(caller module, callee module, function)`` of every call from one big_modeling module into another."""
    seen: set[tuple[str, str, str]] = set()

    def profile(frame, event, arg):
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        callee = frame.f_code.co_filename
        if event == "call" and callee.startswith(PKG) and caller.startswith(PKG) and callee != caller:
            seen.add((os.path.basename(caller)[:-3], os.path.basename(callee)[:-3], frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "disk",
                                                      "blocks.3": "disk", "head": "cpu", "scale": "cpu"}])
def test_dispatch_model_goes_one_way_through_big_modeling(device_map, tmp_path):
    torch.manual_seed(0)
    eager = Net()
    model = Net()
    model.load_state_dict(eager.state_dict())
    x = torch.randn(3, 8)
    calls = calls_between_modules(lambda: modeling.dispatch_model(model, device_map, offload_dir=tmp_path))
    assert {(callee, fn) for caller, callee, fn in calls if caller == "modeling"} == {
        ("device_map", "check_device_map"), ("dispatch", "dispatch")}
    came_back = {c for c in calls if c[1] in ("modeling", "dispatch", "loading")} - {
        ("modeling", "dispatch", "dispatch")}
    assert not came_back
    assert torch.equal(model(x), eager(x))
    assert hasattr(model, "_hf_hook") == (len(device_map) > 1)


def _two_shards(folder):
    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(0)
    eager = Net()
    save_torch_state_dict(eager.state_dict(), folder, max_shard_size=600)
    assert len(list(folder.glob("*.safetensors"))) >= 2
    return eager


def test_a_quick_sharded_load_makes_no_progress_bar(tmp_path, monkeypatch):
    eager = _two_shards(tmp_path)
    made = []
    monkeypatch.setattr(loading, "progress_bar", lambda *a, **k: made.append(k))
    before = {t.name for t in threading.enumerate()}
    with torchbay.init_empty_weights():
        model = Net()
    model = torchbay.load_checkpoint_and_dispatch(model, tmp_path, device_map="auto")
    x = torch.randn(3, 8)
    assert torch.equal(model(x), eager(x))
    assert made == []
    assert {t.name for t in threading.enumerate()} <= before


def test_a_slow_sharded_load_shows_the_shard_bar(tmp_path, monkeypatch, capsys):
    _two_shards(tmp_path)
    monkeypatch.setattr(loading.ShardProgress, "BAR_DELAY_S", 0.0)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    with torchbay.init_empty_weights():
        model = Net()
    torchbay.load_checkpoint_in_model(model, tmp_path)
    shards = len(list(tmp_path.glob("*.safetensors")))
    err = capsys.readouterr().err
    assert "Loading checkpoint shards" in err and f"{shards}/{shards}" in err
