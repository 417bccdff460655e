"""Big-model inference (docs/big-model-inference.md): empty init, device maps, loading, offload.

CPU only and small models: each test runs in well under a second. The accelerator paths
are in tests/big_modeling/test_big_model_devices.py.
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torchbay
from torchbay import utils
from torchbay.errors import CheckpointError, ConfigError

D = 32


class Block(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("steps", torch.arange(3), persistent=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * self.scale


class Net(nn.Module):
    """Embedding, blocks and a head tied to the embedding (made inside the constructor)."""

    def __init__(self, n=6, d=D, vocab=50, tie=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids, past=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def rss_kib(field="RssAnon"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@pytest.fixture
def eager():
    torch.manual_seed(0)
    model = Net().eval()
    for p in model.parameters():  # a visible effect of every weight
        p.data.normal_(0, 0.2)
    return model


@pytest.fixture
def ids():
    return torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))


def hf_state(model):
    """What a Hugging Face save holds: the tied head is not stored."""
    return {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}


@pytest.fixture
def st_file(tmp_path, eager):
    path = tmp_path / "model.safetensors"
    save_file(hf_state(eager), str(path))
    return path


def empty_net(**kwargs):
    with torchbay.init_empty_weights():
        return Net(**kwargs).eval()


# --- empty init -----------------------------------------------------------------------------


def test_empty_init_allocates_no_memory():
    before = rss_kib()
    with torchbay.init_empty_weights():
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(32)])  # 512 MiB in fp32
    assert rss_kib() - before < 64 * 1024, "building the empty model allocated memory"
    assert all(p.device.type == "meta" for p in model.parameters())
    assert utils.compute_module_sizes(model)[""] == 32 * (2048 * 2048 + 2048) * 4


def test_include_buffers_and_ties_made_inside():
    model = empty_net()
    assert model.blocks[0].up.weight.is_meta and not model.blocks[0].scale.is_meta  # buffers stay real
    assert model.head.weight is model.embed.weight
    with torchbay.init_empty_weights(include_buffers=True):
        model = Net()
    assert model.blocks[0].scale.is_meta
    with torchbay.init_on_device("cpu"):
        assert Net().embed.weight.device.type == "cpu"


# --- loading: formats, ties, dtype ---------------------------------------------------------


def test_single_file_auto_equals_eager_and_keeps_the_tie(st_file, eager, ids):
    model = empty_net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the head is tied: its absence from the file is not "missing"
        model = torchbay.load_checkpoint_and_dispatch(model, st_file, device_map="auto")
    assert model.hf_device_map == {"": "cpu"}
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(ids), eager(ids))


def test_cpu_weights_are_views_of_the_mapped_file(tmp_path):
    torch.manual_seed(0)
    big = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB
    save_file(big.state_dict(), str(tmp_path / "big.safetensors"))
    del big
    with torchbay.init_empty_weights():
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    before = rss_kib()
    torchbay.load_checkpoint_and_dispatch(model, tmp_path / "big.safetensors", device_map="auto")
    model(torch.ones(1, 1024))
    assert rss_kib() - before < 16 * 1024, "loading copied the weights into anonymous memory"


def test_sharded_hf_index_folder(tmp_path, eager, ids):
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(hf_state(eager), tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    for checkpoint in (tmp_path, tmp_path / "model.safetensors.index.json"):
        model = torchbay.load_checkpoint_and_dispatch(empty_net(), checkpoint, device_map="sequential")
        assert torch.equal(model(ids), eager(ids))


@pytest.mark.parametrize("kind", ["save_model", "save_state"])
def test_torchbay_checkpoint_folder(tmp_path, eager, ids, kind):
    accelerator = torchbay.Accelerator()
    prepared = accelerator.prepare(eager)
    if kind == "save_model":
        accelerator.save_model(prepared, tmp_path / "ckpt", max_shard_size="20KB")
    else:
        accelerator.save_state(tmp_path / "ckpt")
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "ckpt", device_map="auto")
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(ids), eager(ids))


def test_torch_bin_is_read_weights_only(tmp_path, eager, ids):
    torch.save(eager.state_dict(), tmp_path / "pytorch_model.bin")
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "pytorch_model.bin", device_map="auto")
    assert torch.equal(model(ids), eager(ids))
    torch.save({"weights": Block()}, tmp_path / "evil.bin")  # a pickled module: code would run to rebuild it
    with pytest.raises(CheckpointError, match="will not unpickle"):
        torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "evil.bin", device_map="auto")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "bfloat16"])
def test_dtype_conversion(st_file, eager, ids, dtype):
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), st_file, device_map="auto", dtype=dtype)
    want = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    assert {p.dtype for p in model.parameters()} == {want}
    assert model.blocks[0].steps.dtype == torch.int64  # integers keep theirs
    out = model(ids).float()
    assert torch.allclose(out, eager.to(want)(ids).float(), atol=1e-2, rtol=1e-2)


# --- device maps on cpu + disk -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_each_mode_with_a_cpu_limit_offloads_to_disk(st_file, eager, ids, mode, tmp_path):
    size = utils.compute_module_sizes(empty_net())[""]
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), st_file, device_map=mode,
                                                  max_memory={"cpu": size // 3}, offload_folder=tmp_path / "off",
                                                  no_split_module_classes=["Block"])
    devices = set(model.hf_device_map.values())
    assert devices == {"cpu", "disk"}, model.hf_device_map
    assert any(p.is_meta for p in model.parameters())  # the disk part waits on disk
    assert torch.equal(model(ids), eager(ids))
    assert torch.equal(model(ids), eager(ids))  # and again: the offloaded weights were put back
    assert not list((tmp_path / "off").glob("*.safetensors")), "a safetensors source is read in place, not copied"


def test_disk_offload_under_a_300mb_style_cpu_limit(tmp_path, ids):
    """The issue's case scaled down: the model is ~3x the cpu budget (the issue: 1 GB, "300MB")."""
    torch.manual_seed(0)
    eager = Net(n=8, d=128, vocab=50).eval()
    save_file(hf_state(eager), str(tmp_path / "model.safetensors"))
    total = utils.compute_module_sizes(eager)[""]
    with torchbay.init_empty_weights():
        model = Net(n=8, d=128, vocab=50).eval()
    budget = f"{total // 3 / 1e6:.3f}MB"
    model = torchbay.load_checkpoint_and_dispatch(model, tmp_path / "model.safetensors", device_map="auto",
                                                  max_memory={"cpu": budget}, offload_folder=tmp_path / "off")
    on_disk = [k for k, v in model.hf_device_map.items() if v == "disk"]
    assert len(on_disk) >= 4
    assert torch.equal(model(ids), eager(ids))


def test_explicit_map_and_remove_hook(st_file, eager, ids, tmp_path):
    device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "disk", "blocks.3": "cpu",
                  "blocks.4": "disk", "blocks.5": "cpu", "norm": "cpu", "head": "disk"}
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), st_file, device_map=device_map,
                                                  offload_folder=tmp_path / "off")
    assert model.hf_device_map == device_map
    assert model.blocks[1].up.weight.is_meta and utils.has_offloaded_params(model.blocks[1].up)
    assert torch.equal(model(ids), eager(ids))
    torchbay.remove_hook_from_submodules(model)  # a plain module again, weights on the cpu
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model(ids), eager(ids))


def test_generation_loop_with_offloaded_layers(st_file, eager, ids, tmp_path):
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), st_file, device_map="sequential",
                                                  max_memory={"cpu": 20_000}, offload_folder=tmp_path,
                                                  skip_keys="past")

    def generate(m, steps=5):
        seq = ids
        for _ in range(steps):
            nxt = m(seq, past=None)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        return seq

    assert torch.equal(generate(model), generate(eager))


def test_cpu_offload_disk_offload_and_dispatch_model(eager, ids, tmp_path):
    want = eager(ids)
    for offload in (lambda m: torchbay.cpu_offload(m),
                    lambda m: torchbay.disk_offload(m, tmp_path / "d"),
                    lambda m: torchbay.dispatch_model(m, {"embed": "cpu", "blocks": "cpu", "norm": "cpu",
                                                          "head": "cpu"}, force_hooks=True)):
        model = Net().eval()
        model.load_state_dict(eager.state_dict())
        offload(model)
        assert torch.equal(model(ids), want)
    model, hook = torchbay.cpu_offload_with_hook(Net().eval())
    model.load_state_dict(eager.state_dict())
    assert torch.equal(model(ids), want)
    hook.offload()
    hook.remove()


# --- infer_auto_device_map, memory, capacity ------------------------------------------------


def test_infer_splits_modules_and_cleans_the_result():
    model = empty_net()
    sizes = utils.compute_module_sizes(model)
    one = sizes["blocks.0"]
    device_map = torchbay.infer_auto_device_map(model, max_memory={"cpu": sizes["embed"] + 2.5 * one})
    assert device_map["embed"] == "cpu" and device_map["blocks.0"] == "cpu" and device_map["blocks.1"] == "cpu"
    assert "blocks.2.up" in device_map or "blocks.2" in device_map  # split where the budget ends
    assert device_map["head"] == "cpu"  # tied to the embedding: placed right after it, on its device
    assert torchbay.infer_auto_device_map(model, max_memory={"cpu": "1GB"}) == {"": "cpu"}
    utils.check_device_map(model, device_map)
    with pytest.raises(ConfigError, match="blocks.1"):
        utils.check_device_map(model, {k: v for k, v in device_map.items() if k != "blocks.1"})
    assert utils.find_tied_parameters(model) == [["embed.weight", "head.weight"]]


def test_max_memory_too_small_for_one_unsplittable_module_names_it(st_file):
    model = empty_net()
    block = utils.compute_module_sizes(model)["blocks.0"]
    with pytest.raises(ConfigError) as info:
        torchbay.load_checkpoint_and_dispatch(model, st_file, device_map="auto", max_memory={"cpu": block // 2},
                                              no_split_module_classes=["Block"])
    message = str(info.value)
    assert "module 'blocks.0' (Block" in message and "cannot be split" in message
    assert "short" in message and "max_memory['cpu']" in message and "offload_folder" in message
    assert model.embed.weight.is_meta  # nothing was loaded


def test_max_memory_values_and_keys():
    assert utils.get_max_memory({"cpu": "300MB", "disk": "1GiB"}) == {"cpu": 300 * 10**6, "disk": 2**30}
    default = utils.get_max_memory()
    assert default["cpu"] > 0
    with pytest.raises(ConfigError, match="not a size"):
        utils.get_max_memory({"cpu": "lots"})
    with pytest.raises(ConfigError, match="not known"):
        utils.get_max_memory({"gpu7": "1GB"})


def test_cpu_capacity_comes_from_the_cpu_device_plugin():
    from torchbay.builtin.cpu import CPUBackend

    free, total = CPUBackend.memory_capacity()[0]
    budget = CPUBackend.placement_budget()[0]
    free_after, _ = CPUBackend.memory_capacity()[0]  # other processes allocate meanwhile: the budget lies between
    assert 0 < free <= total
    headroom = int(total * CPUBackend.placement_headroom)
    assert max(0, min(free, free_after) - headroom) <= budget <= max(0, max(free, free_after) - headroom)


def test_device_mode_rejects_unknown_names(st_file):
    with pytest.raises(ConfigError, match="'balanced_low_0', 'sequential'|balanced_low_0, sequential"):
        torchbay.load_checkpoint_and_dispatch(empty_net(), st_file, device_map="fastest")


# --- clear errors ----------------------------------------------------------------------------


def test_missing_keys_are_named_and_nothing_is_loaded(tmp_path, eager):
    state = hf_state(eager)
    del state["blocks.2.up.weight"], state["norm.bias"]
    save_file(state, str(tmp_path / "m.safetensors"))
    model = empty_net()
    with pytest.raises(CheckpointError) as info:
        torchbay.load_checkpoint_and_dispatch(model, tmp_path / "m.safetensors", device_map="auto")
    assert "blocks.2.up.weight" in str(info.value) and "norm.bias" in str(info.value)
    assert "nothing was loaded" in str(info.value)
    assert all(p.is_meta for p in model.parameters())


def test_strict_false_warns_for_weights_the_model_holds_and_unexpected_keys(tmp_path, eager, ids, caplog):
    state = hf_state(eager)
    kept = state.pop("norm.bias")
    state["extra.weight"] = torch.ones(2)
    save_file(state, str(tmp_path / "m.safetensors"))
    model = Net().eval()  # real weights: the missing one keeps its value
    model.norm.bias.data.copy_(kept)
    with pytest.warns(UserWarning) as record, caplog.at_level("WARNING", logger="torchbay"):
        torchbay.load_checkpoint_and_dispatch(model, tmp_path / "m.safetensors", device_map="auto")
    assert "norm.bias" in " ".join(str(w.message) for w in record)
    assert "extra.weight" in caplog.text and "were not used when initializing" in caplog.text  # logged as Accelerate
    assert torch.equal(model(ids), eager(ids))
    with pytest.raises(CheckpointError, match="extra.weight"):
        torchbay.load_checkpoint_and_dispatch(Net(), tmp_path / "m.safetensors", device_map="auto", strict=True)


def test_shape_mismatch_is_named(tmp_path, eager):
    state = hf_state(eager)
    state["norm.weight"] = torch.ones(D + 1)
    save_file(state, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"'norm.weight' has shape \[33\]"):
        torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "m.safetensors", device_map="auto")


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"metadata": {}}), "no \"weight_map\""),
    (json.dumps({"weight_map": {"embed.weight": "model-00009-of-00009.safetensors"}}), "not in"),
    (json.dumps({"weight_map": {"embed.weight": "../elsewhere.safetensors"}}), "no plain file name"),
])
def test_malformed_index_is_a_clear_error(tmp_path, content, match):
    (tmp_path / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CheckpointError, match=match):
        torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path, device_map="auto")


def test_disk_without_offload_folder_for_a_bin_checkpoint_says_what_to_pass(tmp_path, eager):
    torch.save(eager.state_dict(), tmp_path / "w.bin")
    with pytest.raises(ConfigError, match="offload_folder"):
        torchbay.load_checkpoint_in_model(empty_net(), tmp_path / "w.bin",
                                          device_map={"": "cpu", "blocks": "disk"})
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "w.bin", offload_folder=tmp_path / "off",
                                                  device_map={"embed": "cpu", "blocks": "disk", "norm": "cpu",
                                                              "head": "cpu"})
    assert list((tmp_path / "off").glob("torchbay-offload-*.safetensors"))  # copies of the disk part
    index = json.loads((tmp_path / "off" / "index.json").read_text())  # Accelerate's index, safetensors entries
    assert set(index["blocks.0.up.weight"]) == {"safetensors_file", "weight_name", "dtype"}
    assert torch.equal(model(torch.tensor([[1, 2]])), eager(torch.tensor([[1, 2]])))


def test_names_come_from_torchbay_and_torchbay_utils():
    for name in ("init_empty_weights", "init_on_device", "load_checkpoint_and_dispatch", "infer_auto_device_map",
                 "dispatch_model", "cpu_offload", "cpu_offload_with_hook", "disk_offload", "load_checkpoint_in_model"):
        assert callable(getattr(torchbay, name))
    for name in ("infer_auto_device_map", "get_balanced_memory", "compute_module_sizes", "load_checkpoint_in_model",
                 "get_max_memory", "find_tied_parameters", "set_module_tensor_to_device", "remove_hook_from_module"):
        assert callable(getattr(utils, name))


def test_estimate_memory_shows_the_auto_device_map(tmp_path, eager, capsys):
    from torchbay.cli.main import main

    save_file(hf_state(eager), str(tmp_path / "model.safetensors"))
    assert main(["estimate-memory", str(tmp_path / "model.safetensors"), "--format", "json"]) == 0
    placement = json.loads(capsys.readouterr().out)["big_model_inference"]
    assert placement["device_map"] == {"": "cpu"} and placement["max_memory"]["cpu"] > 0
    assert placement["placed"]["cpu"] == sum(t.numel() * t.element_size() for t in hf_state(eager).values())
    assert main(["estimate-memory", str(tmp_path / "model.safetensors")]) == 0
    assert 'device_map="auto" on this machine' in capsys.readouterr().out


def test_one_parameter_given_to_two_modules_stays_one():
    with torchbay.init_empty_weights():
        shared = nn.Parameter(torch.ones(4, 4))
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        a.weight = shared
        b.weight = shared
    assert a.weight is b.weight and a.weight.is_meta


def test_maps_and_sizes_match_accelerates():
    accelerate = pytest.importorskip("accelerate")  # a dev dependency
    import accelerate.utils  # noqa: F811 (binds the submodule on the package importorskip returned)

    model = empty_net()
    assert dict(accelerate.utils.compute_module_sizes(model)) == dict(utils.compute_module_sizes(model))
    for budget in (30_000, 60_000, 100_000, 10**9):  # room for 0, 1, 4 and all of the blocks
        theirs = accelerate.infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
        ours = torchbay.infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
        assert ours == dict(theirs), budget


def test_a_failure_half_way_says_the_model_is_partially_loaded(tmp_path, eager):
    state = eager.state_dict()
    first = {k: v for k, v in state.items() if k.startswith(("embed", "blocks.0"))}
    rest = {k: v for k, v in state.items() if k not in first}
    torch.save(first, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save(rest, tmp_path / "pytorch_model-00002-of-00002.bin")
    (tmp_path / "pytorch_model-00002-of-00002.bin").write_bytes(b"truncated")
    weight_map = {k: "pytorch_model-00001-of-00002.bin" for k in first}
    weight_map.update({k: "pytorch_model-00002-of-00002.bin" for k in rest})
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = empty_net()
    with pytest.raises(CheckpointError, match=r"partially loaded \(\d+ of \d+ tensors replaced\)"):
        torchbay.load_checkpoint_and_dispatch(model, tmp_path, device_map="auto")
    assert not model.embed.weight.is_meta and model.norm.weight.is_meta


def test_a_save_state_of_two_models_asks_which(tmp_path, eager, ids):
    accelerator = torchbay.Accelerator()
    other = Net().eval()
    accelerator.prepare(eager, other)
    accelerator.save_state(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="holds the weights of 2 models .*model_0, model_1"):
        torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "ckpt", device_map="auto")
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "ckpt" / "model_0.safetensors",
                                                  device_map="auto")
    assert torch.equal(model(ids), eager(ids))


@pytest.mark.parametrize("offload_buffers", [False, True])
def test_disk_offload_with_a_dtype_and_buffers(st_file, eager, ids, tmp_path, offload_buffers):
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), st_file, device_map={"": "disk"},
                                                  offload_folder=tmp_path, dtype=torch.bfloat16,
                                                  offload_buffers=offload_buffers)
    assert model.blocks[0].up.weight.is_meta and model.blocks[0].up.weight.dtype == torch.bfloat16
    assert model.blocks[0].scale.is_meta == offload_buffers
    out = model(ids)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), eager.to(torch.bfloat16)(ids).float(), atol=1e-2, rtol=1e-2)


def test_a_checkpoint_written_again_is_read_again_under_disk_offload(tmp_path, eager, ids):
    path = tmp_path / "model.safetensors"
    save_file(hf_state(eager), str(path))
    first = torchbay.load_checkpoint_and_dispatch(empty_net(), path, device_map={"": "disk"}, offload_folder=tmp_path)
    assert torch.equal(first(ids), eager(ids))
    changed = Net().eval()
    save_file(hf_state(changed), str(path))  # same path, new weights
    second = torchbay.load_checkpoint_and_dispatch(empty_net(), path, device_map={"": "disk"}, offload_folder=tmp_path)
    assert torch.equal(second(ids), changed(ids))


def test_loading_again_into_a_dispatched_model_takes_the_new_weights(tmp_path, eager, ids):
    save_file(hf_state(eager), str(tmp_path / "a.safetensors"))
    changed = Net().eval()
    save_file(hf_state(changed), str(tmp_path / "b.safetensors"))
    device_map = {"embed": "cpu", "blocks": "disk", "norm": "cpu", "head": "cpu"}
    model = torchbay.load_checkpoint_and_dispatch(empty_net(), tmp_path / "a.safetensors", device_map=device_map,
                                                  offload_folder=tmp_path / "off")
    assert torch.equal(model(ids), eager(ids))
    model = torchbay.load_checkpoint_and_dispatch(model, tmp_path / "b.safetensors", device_map="auto")
    assert torch.equal(model(ids), changed(ids))


def test_dispatching_an_empty_model_names_what_has_no_value():
    model = empty_net()
    for device_map in ({"": "cpu"}, {"embed": "cpu", "blocks": "cpu", "norm": "cpu", "head": "cpu"}):
        with pytest.raises(ConfigError, match="embed.weight = head.weight"):
            torchbay.dispatch_model(model, device_map, force_hooks=len(device_map) == 1)
        assert all(p.is_meta for p in model.parameters())


def test_shape_mismatch_and_unexpected_keys_are_reported_as_accelerate(tmp_path, caplog):
    accelerate = pytest.importorskip("accelerate")  # a dev dependency
    import accelerate.utils  # noqa: F811

    model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    said = []
    for side in (accelerate.utils, torchbay.utils):
        with pytest.raises(ValueError) as wrong_shape:
            side.set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.zeros(2, 2))
        said.append(str(wrong_shape.value))
    assert said[0] == said[1]
    state = {**model.state_dict(), "foo": torch.ones(2)}
    torch.save(state, tmp_path / "m.pt")
    with caplog.at_level("WARNING"):
        torchbay.utils.load_checkpoint_in_model(torch.nn.Sequential(torch.nn.Linear(3, 4)), str(tmp_path / "m.pt"))
    assert "were not used when initializing" in caplog.text and "foo" in caplog.text
    for side in (accelerate.utils, torchbay.utils):  # (Accelerate's is torch's RuntimeError, ours a ValueError)
        with pytest.raises((ValueError, RuntimeError)):
            side.load_checkpoint_in_model(torch.nn.Sequential(torch.nn.Linear(3, 4)), str(tmp_path / "m.pt"),
                                          strict=True)
