"""infer_auto_device_map places a model by Accelerate's rules (core/torchbay/big_modeling/infer.py).

Each case is a small model whose byte sizes are worked out in its comment, and the map Accelerate
1.15 infers for it, written out; where Accelerate is installed (the dev environment), the last test
checks each literal map against it too.
"""

import logging
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import torchbay
from torchbay import utils
from torchbay.axes.device import DeviceBackend
from torchbay.registry.manager import PluginManager, hookimpl, reset_plugin_manager


def trio(extra_buffer=0):
    """a: Linear(4, 4) 80 bytes; n: LayerNorm(4) 32 bytes; b: Linear(4, 8) 160 bytes (+ a buffer)."""
    model = nn.Sequential(OrderedDict([("a", nn.Linear(4, 4)), ("n", nn.LayerNorm(4)), ("b", nn.Linear(4, 8))]))
    if extra_buffer:
        model.b.register_buffer("table", torch.zeros(extra_buffer))
    return model


def three_trios():
    """first, second: 272 bytes each; third.b.weight is first.b.weight, so third counts 144."""
    model = nn.Sequential(OrderedDict([("first", trio()), ("second", trio()), ("third", trio())]))
    model.third.b.weight = model.first.b.weight
    return model


def big_small_mid(nested):
    """big: Linear(16, 16) 1088 bytes; small: Linear(2, 2) 24; mid: Linear(8, 8) 288."""
    big, small, mid = nn.Linear(16, 16), nn.Linear(2, 2), nn.Linear(8, 8)
    if nested:
        return nn.Sequential(OrderedDict([("big", big), ("rest", nn.Sequential(OrderedDict([("small", small),
                                                                                            ("mid", mid)])))]))
    return nn.Sequential(OrderedDict([("big", big), ("small", small), ("mid", mid)]))


def with_batchnorm():
    """a 80; n: BatchNorm1d(4) 32 of weights + 40 of buffers; b: 160 + a 200-byte buffer."""
    model = nn.Sequential(OrderedDict([("a", nn.Linear(4, 4)), ("n", nn.BatchNorm1d(4)), ("b", nn.Linear(4, 8))]))
    model.b.register_buffer("table", torch.zeros(50))
    return model


class Holder(nn.Module):
    """Two Linear(4, 4) children (80 bytes each) and a buffer of its own (16 bytes)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))


def with_holder():
    return nn.Sequential(OrderedDict([("first", nn.Linear(4, 8)), ("h", Holder()), ("last", nn.Linear(4, 8))]))


# (model factory, infer_auto_device_map keywords, the map Accelerate 1.15 infers)
CASES = {
    # device 0 keeps 160 (b, the largest layer) free: a (80) fits in its 90, n does not
    "room kept on the first accelerator": (trio, {"max_memory": {0: 250, 1: 250}}, {"a": 0, "n": 1, "b": 1}),
    # the second accelerator keeps nothing: n and b fill its 192 exactly
    "no room kept on the second": (trio, {"max_memory": {0: 250, 1: 192}}, {"a": 0, "n": 1, "b": 1}),
    # first (272) and third (144) together need 416 of device 0's 340: third is split, and first
    # takes third.b (32 left once the tied weight is counted) along
    "tied pieces go together": (three_trios, {"max_memory": {0: 500, 1: 600}},
                                {"first": 0, "third.b": 0, "second": 1, "third.a": 1, "third.n": 1}),
    # first, second and third are layers now: first fits in device 0's 328 but not with third (416),
    # which cannot be split, so both go on to device 1, and second after them
    "no split class": (three_trios, {"max_memory": {0: 600, 1: 700}, "no_split_module_classes": ["Sequential"]},
                       {"": 1}),
    "no split class, room for both": (three_trios, {"max_memory": {0: 700, 1: 700},
                                                    "no_split_module_classes": ["Sequential"]}, {"": 0}),
    # big needs 1088 of the 912 left once mid's 288 is kept: without fallback device 0 is left empty
    "nothing fits device 0": (lambda: big_small_mid(False), {"max_memory": {0: 1200}}, {"": "disk"}),
    "fallback allocation": (lambda: big_small_mid(False), {"max_memory": {0: 1200}, "fallback_allocation": True},
                            {"small": 0, "big": "disk", "mid": "disk"}),
    "fallback inside a later module": (lambda: big_small_mid(True), {"max_memory": {0: 1200},
                                                                     "fallback_allocation": True},
                                       {"rest.small": 0, "big": "disk", "rest.mid": "disk"}),
    # device 0 keeps 360 (b with its buffer): a fits its 140, n (72) does not
    "buffers offloaded": (with_batchnorm, {"max_memory": {0: 500, "cpu": "1GB"}},
                          {"a": 0, "n": "cpu", "b": "cpu"}),
    "buffers on a second accelerator": (with_batchnorm, {"max_memory": {0: 500, 1: 300, "cpu": "1GB"}},
                                        {"a": 0, "n": 1, "b": "cpu"}),
    # h (176) does not fit in the 170 left on device 0: it is split, and its pieces (its own buffer
    # is not one) all go to the cpu
    "a split module's buffer": (with_holder, {"max_memory": {0: 330, "cpu": "1GB"}},
                                {"first": 0, "h": "cpu", "last": "cpu"}),
    "cpu only": (trio, {"max_memory": {"cpu": 250}}, {"a": "cpu", "n": "disk", "b": "disk"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_placement_matches_accelerates_rules(case):
    make, kwargs, expected = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torchbay.infer_auto_device_map(make(), **kwargs) == expected


def test_a_split_modules_own_buffer_is_covered():
    model = with_holder()
    device_map = torchbay.infer_auto_device_map(model, max_memory={0: 420, "cpu": "1GB"})
    # h is split over device 0 and the cpu; h.scale, placed by no piece, follows h.lin (Accelerate
    # leaves it out, and its map fails check_device_map)
    assert device_map == {"first": 0, "h.lin": 0, "h.lin2": "cpu", "h.scale": 0, "last": "cpu"}
    utils.check_device_map(model, device_map)


def test_offloaded_buffers_warn_only_when_no_accelerator_holds_them():
    model = with_batchnorm()  # n and b offloaded: 240 bytes of buffers; device 0 has 500 - 440 left
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        torchbay.infer_auto_device_map(model, max_memory={0: 500, "cpu": "1GB"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchbay.infer_auto_device_map(model, max_memory={0: 500, "cpu": "1GB"}, offload_buffers=True)
        # b alone offloaded (200 bytes): device 1 holds n (72) and has room for them
        torchbay.infer_auto_device_map(model, max_memory={0: 500, 1: 300, "cpu": "1GB"})


def test_a_device_left_empty_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="torchbay"):
        torchbay.infer_auto_device_map(big_small_mid(False), max_memory={0: 1200})
    assert "insufficient memory" in caplog.text and "0 needs at least 1376 bytes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchbay"):
        torchbay.infer_auto_device_map(big_small_mid(False), max_memory={0: 1200}, fallback_allocation=True)
    assert "insufficient memory" not in caplog.text


def test_without_disk_the_layer_too_large_to_run_is_named():
    with pytest.raises(torchbay.ConfigError, match=r"module 'b' \(Linear, 160 bytes\).*max_memory\['cpu'\]"):
        torchbay.infer_auto_device_map(trio(), max_memory={"cpu": 150}, offload_to_disk=False)


class Unified(DeviceBackend):
    """A stand-in device whose memory is the host's (as Apple's mps); never touched (maps only)."""

    name = device_type = "unifiedfake"
    priority = 1000
    shares_host_memory = True

    @classmethod
    def unavailable_reason(cls):
        return None

    @classmethod
    def device_count(cls):
        return 1


class UnifiedPlugin:
    @hookimpl
    def torchbay_register_devices(self):
        return [Unified]


@pytest.fixture
def unified():
    pm = PluginManager()
    pm.register_plugin(UnifiedPlugin(), "unified-device")
    reset_plugin_manager(pm)
    yield
    reset_plugin_manager(None)


def test_a_device_sharing_the_hosts_memory_keeps_room_alone(unified):
    # device 0 keeps b's 160 of its 200, so a moves on; the cpu keeps nothing apart and takes a and n
    # (112), b (160 more) goes to disk. Where the cpu keeps room too, nothing fits in its 40.
    assert torchbay.infer_auto_device_map(trio(), max_memory={0: 200, "cpu": 200}) == {"a": "cpu", "n": "cpu",
                                                                                        "b": "disk"}
    reset_plugin_manager(None)
    assert torchbay.infer_auto_device_map(trio(), max_memory={0: 200, "cpu": 200}) == {"": "disk"}


def test_literal_maps_are_accelerates():
    accelerate_utils = pytest.importorskip("accelerate.utils")  # a dev dependency
    for case, (make, kwargs, expected) in CASES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = accelerate_utils.infer_auto_device_map(make(), **kwargs)
        assert dict(theirs) == expected, case
    # Accelerate names Apple's unified-memory device "mps"
    assert dict(accelerate_utils.infer_auto_device_map(trio(), max_memory={"mps": 200, "cpu": 200})) == \
        {"a": "cpu", "n": "cpu", "b": "disk"}
