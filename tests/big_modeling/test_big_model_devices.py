"""Big-model placement on accelerators: capacity from the device plugins, balanced splits.

A stand-in device plugin (registered through the plugin manager, as a vendor's would be)
tests the maps on any machine; the real-device tests run through whichever device plugin
has an available device (torchbay-cuda on a GPU machine) and skip, naming what is missing,
elsewhere.
"""

import pytest
import torch
from torch import nn

import torchbay
from torchbay import utils
from torchbay.axes.device import DeviceBackend
from torchbay.big_modeling.device_map import accelerator_class
from torchbay.registry.manager import PluginManager, hookimpl, reset_plugin_manager
from torchbay.testing.conformance import run_check

GIB = 2**30


class FakeAccel(DeviceBackend):
    """Two devices of 1 GiB each, 600 MiB free on the first; never touched (maps only)."""

    name = "fakeaccel"
    device_type = "fakeaccel"
    priority = 1000

    @classmethod
    def unavailable_reason(cls):
        return None

    @classmethod
    def device_count(cls):
        return 2

    @classmethod
    def memory_capacity(cls):
        return {0: (600 * 2**20, GIB), 1: (GIB, GIB)}


class LyingCapacity(FakeAccel):
    name = "lying"

    @classmethod
    def memory_capacity(cls):
        return {0: (2 * GIB, GIB)}  # more free than total, and one index short


class FakePlugin:
    @hookimpl
    def torchbay_register_devices(self):
        return [FakeAccel, LyingCapacity]


@pytest.fixture
def fake():
    pm = PluginManager()
    pm.register_plugin(FakePlugin(), "fake-devices")
    reset_plugin_manager(pm)
    yield pm
    reset_plugin_manager(None)


def layered(n=8, width=1024):
    with torchbay.init_empty_weights():
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def test_capacity_and_budget_come_from_the_device_plugin(fake):
    assert accelerator_class() is FakeAccel
    budget = utils.get_max_memory()
    assert list(budget)[:2] == [0, 1] and "cpu" in budget
    assert budget[0] == 600 * 2**20 - int(GIB * 0.1) and budget[1] == GIB - int(GIB * 0.1)  # headroom
    assert utils.get_max_memory({"fakeaccel:1": "1GB", 0: 10, "cpu": "2GB"}) == {0: 10, 1: 10**9, "cpu": 2 * 10**9}


def test_balanced_spreads_over_both_devices(fake):
    model = layered()  # 8 x 4 MiB
    per_layer = utils.compute_module_sizes(model)["0"]
    memory = utils.get_balanced_memory(model, max_memory={0: "1GB", 1: "1GB", "cpu": "1GB"})
    device_map = torchbay.infer_auto_device_map(model, max_memory=memory)
    counts = {d: sum(1 for v in device_map.values() if v == d) for d in (0, 1)}
    assert counts[0] >= 3 and counts[1] >= 3, device_map
    assert memory[0] <= 5 * per_layer
    sequential = torchbay.infer_auto_device_map(model, max_memory={0: "1GB", 1: "1GB", "cpu": "1GB"})
    assert sequential == {"": 0}


def test_balanced_low_0_keeps_the_first_device_free_when_the_rest_suffices(fake):
    model = layered()
    memory = utils.get_balanced_memory(model, max_memory={0: "1GB", 1: "1GB", "cpu": "1GB"}, low_zero=True)
    assert memory[0] == 0
    device_map = torchbay.infer_auto_device_map(model, max_memory=memory)
    assert set(device_map.values()) == {1}


def test_offloading_keeps_room_for_the_largest_layer_on_the_first_device(fake):
    model = layered()
    layer = utils.compute_module_sizes(model)["0"]
    device_map = torchbay.infer_auto_device_map(model, max_memory={0: 3 * layer, "cpu": "1GB"}, clean_result=False)
    assert sum(1 for v in device_map.values() if v == 0) == 2  # 3 layers' room, one kept for offloaded layers
    assert set(device_map.values()) == {0, "cpu"}


def test_conformance_placement_names_a_lying_capacity(fake):
    result = run_check("placement", "lying", pm=fake)
    assert result.status == "failed"
    assert "memory_capacity() must return {index: (free, total)} for the indexes 0..1" in result.message


def test_conformance_placement_passes_on_cpu():
    result = run_check("placement", "cpu")
    assert result.status == "passed", str(result)


# --- a real accelerator -----------------------------------------------------------------------

REAL = accelerator_class()
needs_device = pytest.mark.skipif(
    REAL is None, reason="no accelerator here: these tests need a device plugin whose "
                         "device is available (e.g. torchbay-cuda on a machine with a GPU)")


class Net(nn.Module):
    def __init__(self, n=8, d=256, vocab=100):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@needs_device
def test_real_device_passes_the_placement_check():
    result = run_check("placement", REAL.name)
    assert result.status == "passed", str(result)


@needs_device
def test_real_device_balanced_split_and_generation(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    eager = Net().eval()
    save_file({k: v for k, v in eager.state_dict().items() if k != "head.weight"}, str(tmp_path / "m.safetensors"))
    size = utils.compute_module_sizes(eager)[""]
    count = REAL.device_count()
    if count >= 2:
        max_memory = {0: size // 2, 1: size, "cpu": "1GB"}
    else:  # one device: half of it there, the rest offloaded to the cpu and run on it
        max_memory = {0: size // 2, "cpu": "1GB"}
    with torchbay.init_empty_weights():
        model = Net().eval()
    model = torchbay.load_checkpoint_and_dispatch(model, tmp_path / "m.safetensors", device_map="balanced",
                                                  max_memory=max_memory)
    placed = set(model.hf_device_map.values())
    assert 0 in placed and (1 in placed or "cpu" in placed), model.hf_device_map
    ids = torch.randint(0, 100, (2, 6))
    out = model(ids)
    assert out.device == ids.device
    assert torch.allclose(out, eager(ids), atol=1e-3, rtol=1e-3)
    seq_a, seq_b = ids, ids
    for _ in range(4):
        seq_a = torch.cat([seq_a, model(seq_a)[:, -1:].argmax(-1)], 1)
        seq_b = torch.cat([seq_b, eager(seq_b)[:, -1:].argmax(-1)], 1)
    assert torch.equal(seq_a, seq_b)
