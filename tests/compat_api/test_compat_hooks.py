"""accelerate.hooks and the offload helpers of accelerate.utils on torchbay, against Accelerate itself.

Each test runs the same calls on Accelerate (installed in the dev environment) and on torchbay
(``torchbay.compat.hooks``, the module that answers ``accelerate.hooks`` under
``TORCHBAY_AS_ACCELERATE=1``, and ``torchbay.utils``) and compares outputs, devices and the
``_hf_hook`` fields that transformers, peft and diffusers read. CPU only, small modules.
"""

import inspect
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torchbay
from torchbay import utils as tb_utils
from torchbay.compat import hooks as tb_hooks
from torchbay.errors import CheckpointError

accelerate = pytest.importorskip("accelerate", reason="Accelerate (a dev dependency) is the reference")
import accelerate.hooks as acc_hooks  # noqa: E402
import accelerate.utils as acc_utils  # noqa: E402

SIDES = {"accelerate": (acc_hooks, acc_utils, accelerate), "torchbay": (tb_hooks, tb_utils, torchbay)}


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("steps", torch.arange(3), persistent=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * self.scale


class Net(nn.Module):
    def __init__(self, n=3, d=8, vocab=20):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, extra=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def net():
    torch.manual_seed(0)
    model = Net().eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model


IDS = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))


def both(build):
    """``build(hooks, utils, top)`` on each side: ``{side: result}``."""
    return {side: build(*mods) for side, mods in SIDES.items()}


def hook_fields(model):
    """What the libraries read of every module's hook."""
    out = {}
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        if hook is None:
            continue
        hooks = hook.hooks if type(hook).__name__ == "SequentialHook" else (hook,)
        out[name] = [(type(h).__name__, getattr(h, "offload", None), getattr(h, "io_same_device", None),
                      getattr(h, "place_submodules", None), str(getattr(h, "execution_device", None)),
                      type(getattr(h, "weights_map", None)).__name__,
                      getattr(getattr(h, "weights_map", None), "prefix", None)) for h in hooks]
    return out


def placement(model):
    return {n: str(t.device) for n, t in list(model.named_parameters()) + list(model.named_buffers())}


# --- the hook protocol ---------------------------------------------------------------------


def test_a_model_hook_subclass_sees_the_same_calls_and_changes_the_same_values():
    def run(hooks, utils, top):
        calls = []

        class Scale(hooks.ModelHook):
            def init_hook(self, module):
                calls.append("init")
                return module

            def pre_forward(self, module, *args, **kwargs):
                calls.append(("pre", len(args), sorted(kwargs)))
                return (args[0] * 2,), kwargs

            def post_forward(self, module, output):
                calls.append("post")
                return output + 1

            def detach_hook(self, module):
                calls.append("detach")
                return module

        class NoGrad(hooks.ModelHook):
            no_grad = True

        torch.manual_seed(0)
        layer = nn.Linear(3, 3)
        original = layer.forward
        hooks.add_hook_to_module(layer, Scale())
        assert layer._old_forward == original
        x = torch.ones(2, 3)
        out = layer(x)
        hooks.add_hook_to_module(layer, NoGrad(), append=True)
        chained = type(layer._hf_hook).__name__, [type(h).__name__ for h in layer._hf_hook.hooks]
        hooks.remove_hook_from_module(layer)
        out_no_grad = hooks.add_hook_to_module(nn.Linear(3, 3), NoGrad())(x)
        assert not hasattr(layer, "_hf_hook") and not hasattr(layer, "_old_forward")
        return out.detach(), out_no_grad.requires_grad, chained, calls, layer(x).detach()

    results = both(run)
    theirs, ours = results["accelerate"], results["torchbay"]
    assert torch.equal(ours[0], theirs[0]) and ours[1:4] == theirs[1:4]
    assert ours[1] is False and ours[2] == ("SequentialHook", ["Scale", "NoGrad"])
    assert torch.equal(ours[4], theirs[4])


@pytest.mark.parametrize("offload_buffers", [False, True])
@pytest.mark.parametrize("place_submodules", [False, True])
def test_align_devices_hook_offloads_like_accelerate(offload_buffers, place_submodules):
    torch.manual_seed(0)
    want = Block()(torch.ones(2, 8))

    def run(hooks, utils, top):
        torch.manual_seed(0)
        block = Block()
        hook = hooks.AlignDevicesHook(execution_device="cpu", offload=True, io_same_device=True,
                                      offload_buffers=offload_buffers, place_submodules=place_submodules)
        hooks.add_hook_to_module(block, hook)
        during = placement(block)
        out = block(torch.ones(2, 8))
        fields = (sorted(hook.weights_map), {k: str(v) for k, v in hook.original_devices.items()},
                  utils.has_offloaded_params(block))
        # peft's way of bringing one layer in: pre_forward with the module only, then post_forward
        hook.pre_forward(block)
        present = placement(block)
        hook.post_forward(block, torch.tensor([]))
        hooks.remove_hook_from_module(block)
        return out.detach(), during, fields, present, placement(block)

    results = both(run)
    theirs, ours = results["accelerate"], results["torchbay"]
    assert torch.equal(ours[0], want) and torch.equal(theirs[0], want)
    assert ours[1:] == theirs[1:]


def test_attach_align_device_hook_and_on_blocks_put_the_same_hooks_where_accelerate_does():
    def run(hooks, utils, top):
        model = net()
        state = model.state_dict()
        hooks.attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=state,
                                       preload_module_classes=["Block"])
        first = hook_fields(model), model(IDS).detach()
        hooks.remove_hook_from_submodules(model)
        blocks = net()
        execution = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "cpu", "norm": "cpu",
                     "head": "cpu"}
        offload = {"embed": False, "blocks.0": True, "blocks.1": False, "blocks.2": True, "norm": False,
                   "head": True}
        hooks.attach_align_device_hook_on_blocks(blocks, execution_device=execution, offload=offload,
                                                 weights_map=blocks.state_dict())
        return first, (hook_fields(blocks), blocks(IDS).detach())

    results = both(run)
    for theirs, ours in zip(results["accelerate"], results["torchbay"]):
        assert ours[0] == theirs[0]
        assert torch.equal(ours[1], theirs[1])
    assert torch.equal(results["torchbay"][0][1], net()(IDS))


def test_cpu_offload_and_cpu_offload_with_hook_as_accelerate():
    want = net()(IDS)

    def run(hooks, utils, top):
        model = top.cpu_offload(net(), execution_device="cpu")
        fields, out = hook_fields(model), model(IDS).detach()
        hooks.remove_hook_from_submodules(model)
        first, hook_a = top.cpu_offload_with_hook(net(), execution_device="cpu")
        second, hook_b = top.cpu_offload_with_hook(net(), execution_device="cpu", prev_module_hook=hook_a)
        chained = (type(hook_b).__name__, type(second._hf_hook).__name__,
                   second._hf_hook.prev_module_hook is hook_a, str(second._hf_hook.execution_device))
        out2 = second(first(IDS).argmax(-1)).detach()
        hook_a.offload()
        hook_a.remove()
        return fields, out, chained, out2, hasattr(first, "_hf_hook")

    results = both(run)
    theirs, ours = results["accelerate"], results["torchbay"]
    assert ours[0] == theirs[0] and ours[2] == theirs[2] and ours[4] == theirs[4] is False
    assert torch.equal(ours[1], want) and torch.equal(ours[3], theirs[3])


def test_dispatch_model_with_disk_places_and_reads_as_accelerate(tmp_path):
    model = net()
    want = model(IDS)
    device_map = {"embed": "cpu", "blocks.0": "disk", "blocks.1": "cpu", "blocks.2": "disk", "norm": "cpu",
                  "head": "disk"}

    def run(hooks, utils, top, folder):
        model = net()
        top.dispatch_model(model, device_map, offload_dir=folder)
        out = model(IDS).detach()
        offloaded = sorted(n for n, m in model.named_modules() if utils.has_offloaded_params(m))
        # transformers' load_offloaded_parameter: the nearest hooked module's weights_map, by relative name
        read = {}
        for name, param in model.named_parameters():
            if param.is_meta:
                owner, _, leaf = name.rpartition(".")
                read[name] = model.get_submodule(owner)._hf_hook.weights_map[leaf]
        return out, offloaded, placement(model), read, model.hf_device_map

    theirs = run(acc_hooks, acc_utils, accelerate, tmp_path / "acc")
    ours = run(tb_hooks, tb_utils, torchbay, tmp_path / "tb")
    assert torch.equal(ours[0], want) and torch.equal(theirs[0], want)
    assert ours[1] == theirs[1] and ours[2] == theirs[2] and ours[4] == theirs[4]
    assert ours[3].keys() == theirs[3].keys()
    for name in ours[3]:
        assert torch.equal(ours[3][name], model.get_parameter(name))
    with tb_utils.align_module_device(model.blocks[0].up, "cpu"):  # a plain module: nothing to bring in
        assert not model.blocks[0].up.weight.is_meta


def test_layerwise_casting_hook_stores_low_and_computes_high_as_accelerate():
    def run(hooks, utils, top):
        torch.manual_seed(0)
        layer = nn.Linear(4, 4)
        hooks.add_hook_to_module(layer, hooks.LayerwiseCastingHook(torch.bfloat16, torch.float32, False))
        stored = layer.weight.dtype
        out = layer(torch.ones(2, 4))
        return stored, out.dtype, out.detach(), layer.weight.dtype

    results = both(run)
    assert results["torchbay"][:2] == results["accelerate"][:2] == (torch.bfloat16, torch.float32)
    assert torch.equal(results["torchbay"][2], results["accelerate"][2])
    assert results["torchbay"][3] == results["accelerate"][3] == torch.bfloat16


class CallsItselfOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen_meta = []

    def forward(self, x, again=True):
        y = self.lin(x)
        if again:
            y = self(y, again=False)  # through the hooked forward again
            self.seen_meta.append(self.lin.weight.is_meta)
        return y


def test_torchbays_choices_where_they_differ_from_accelerate(tmp_path):
    """docs/big-model-inference.md, "Hooks": a failed forward lets offloaded weights go; a module called
    again inside its own forward keeps them; a tie placed on two devices stays one tensor (lent)."""
    block = Block()
    hook = tb_hooks.AlignDevicesHook(execution_device="cpu", offload=True, place_submodules=True)
    tb_hooks.add_hook_to_module(block, hook)
    with pytest.raises(RuntimeError):
        block(torch.ones(2, 3))  # wrong width: the forward raises
    assert all(p.is_meta for p in block.parameters()) and hook._depth == 0
    assert block(torch.ones(2, 8)).shape == (2, 8)  # and the next forward brings them in again

    module = CallsItselfOnce()
    want = module.lin(module.lin(torch.ones(1, 8)))
    tb_hooks.add_hook_to_module(module, tb_hooks.AlignDevicesHook(execution_device="cpu", offload=True,
                                                                  place_submodules=True))
    assert torch.equal(module(torch.ones(1, 8)), want)
    assert module.seen_meta == [False] and module.lin.weight.is_meta

    model = net()
    model.head.weight = model.embed.weight = nn.Parameter(torch.randn(20, 8))
    want = model(IDS)
    torchbay.dispatch_model(model, {"embed": "cpu", "blocks": "disk", "norm": "cpu", "head": "disk"},
                            offload_dir=tmp_path)
    assert model.head.weight is model.embed.weight  # the tie survives between forwards
    assert torch.equal(model(IDS), want) and model.head.weight is model.embed.weight


def test_a_compiled_offloaded_model_gives_the_eager_output_and_traces_no_hook():
    """The hooks' work stays out of torch.compile's graphs (torch.compiler.disable once dynamo is loaded):
    traced, each hook's weight moves would be captured and recompiled (8 graphs for these 3 calls, 2 without)."""
    from torch._dynamo.utils import counters

    model = net()
    want = model(IDS)
    torchbay.cpu_offload(model, execution_device="cpu")
    compiled = torch.compile(model, backend="eager")
    counters.clear()
    outputs = [compiled(IDS) for _ in range(3)]
    assert all(torch.equal(out, want) for out in outputs)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert all(p.is_meta for p in model.blocks[0].up.parameters())  # offloaded again after each call


# --- the offload index, both forms ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_dat_files_are_read_and_written_as_accelerate_does(tmp_path, dtype):
    tensors = {"a.weight": (torch.arange(12).reshape(3, 4) * 0.25).to(dtype), "scalar": torch.tensor(3).to(dtype)}
    index_acc, index_tb = {}, {}
    (tmp_path / "acc").mkdir()  # Accelerate's offload_weight expects the folder
    for name, tensor in tensors.items():
        acc_utils.offload_weight(tensor, name, str(tmp_path / "acc"), index_acc)
        tb_utils.offload_weight(tensor, name, tmp_path / "tb", index_tb)
    assert index_tb == index_acc
    for name, tensor in tensors.items():  # each reads the other's files
        assert torch.equal(tb_utils.load_offloaded_weight(tmp_path / "acc" / f"{name}.dat", index_acc[name]), tensor)
        assert torch.equal(acc_utils.load_offloaded_weight(str(tmp_path / "tb" / f"{name}.dat"), index_tb[name]),
                           tensor)


def test_offload_state_dict_index_and_loading_back_match_accelerate(tmp_path):
    state = net().state_dict()
    acc_utils.offload_state_dict(str(tmp_path / "acc"), state)
    tb_utils.offload_state_dict(tmp_path / "tb", state)
    assert json.loads((tmp_path / "tb" / "index.json").read_text()) == \
        json.loads((tmp_path / "acc" / "index.json").read_text())
    loader = tb_utils.OffloadedWeightsLoader(save_folder=tmp_path / "acc")
    assert sorted(loader) == sorted(state) and all(torch.equal(loader[k], v) for k, v in state.items())
    prefixed = tb_utils.PrefixedDataset(loader, "blocks.1.")
    assert torch.equal(prefixed["up.weight"], state["blocks.1.up.weight"])
    assert sorted(prefixed) == sorted(k for k in state if k.startswith("blocks.1."))  # full names, as Accelerate
    with torchbay.init_empty_weights():
        empty = Net()
    index = json.loads((tmp_path / "acc" / "index.json").read_text())
    params = {k: v for k, v in index.items() if k in dict(empty.named_parameters())}
    tb_utils.load_offloaded_weights(empty, params, tmp_path / "acc")
    assert all(torch.equal(empty.get_parameter(k), state[k]) for k in params)


def test_dispatch_model_reads_an_offload_folder_accelerate_wrote(tmp_path):
    model = net()
    want = model(IDS)
    acc_utils.offload_state_dict(str(tmp_path), model.state_dict())  # .dat files and index.json
    with torchbay.init_empty_weights():
        empty = Net().eval()
    empty.blocks[0].steps = torch.arange(3)  # non-persistent buffers are in no offload folder
    for block in empty.blocks:
        block.steps = torch.arange(3)
    torchbay.dispatch_model(empty, {"": "disk"}, offload_dir=tmp_path)
    assert torch.equal(empty(IDS), want)


def test_dispatch_model_takes_the_index_transformers_writes(tmp_path):
    """Entries that point into the original safetensors checkpoint ({"safetensors_file", "weight_name",
    "dtype"}), as from_pretrained passes them for its "disk" placements."""
    model = net()
    want = model(IDS)
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    device_map = {"embed": "cpu", "blocks": "disk", "norm": "cpu", "head": "cpu"}
    index = {k: {"safetensors_file": str(tmp_path / "model.safetensors"), "weight_name": k, "dtype": "float32"}
             for k in model.state_dict() if k.startswith("blocks.")}
    results = {}
    for side, top in (("accelerate", accelerate), ("torchbay", torchbay)):
        with torchbay.init_empty_weights():
            empty = Net().eval()
        state = model.state_dict()
        for name, tensor in state.items():  # the cpu part loaded, the disk part left on meta
            if not name.startswith("blocks."):
                tb_utils.set_module_tensor_to_device(empty, name, "cpu", value=tensor)
        top.dispatch_model(empty, device_map, offload_index=index, offload_dir=None)
        results[side] = (empty(IDS).detach(), hook_fields(empty).get("blocks.0.up"))
    assert torch.equal(results["torchbay"][0], want) and torch.equal(results["accelerate"][0], want)
    assert results["torchbay"][1][0][:2] == results["accelerate"][1][0][:2] == ("AlignDevicesHook", True)
    assert not list(tmp_path.glob("*.dat"))  # read in place, nothing copied


def test_offload_weight_never_overwrites_a_file_torchbay_did_not_write(tmp_path):
    (tmp_path / "w.dat").write_bytes(b"someone else's")
    with pytest.raises(CheckpointError, match="did not write.*w.dat|w.dat.*did not write"):
        tb_utils.offload_weight(torch.ones(2), "w", tmp_path, {})
    assert (tmp_path / "w.dat").read_bytes() == b"someone else's"
    (tmp_path / "index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="index.json"):
        tb_utils.save_offload_index({"v": {"dtype": "float32", "shape": [2]}}, tmp_path)
    index = tb_utils.offload_weight(torch.ones(2), "v", tmp_path / "mine", {})
    tb_utils.offload_weight(torch.zeros(2), "v", tmp_path / "mine", index)  # its own file: written again
    assert torch.equal(tb_utils.load_offloaded_weight(tmp_path / "mine" / "v.dat", index["v"]), torch.zeros(2))


# --- accelerate.utils.modeling helpers -----------------------------------------------------


def test_get_max_memory_converts_the_callers_dict_in_place():
    for utils in (acc_utils, tb_utils):
        max_memory = {"cpu": "300MB"}
        result = utils.get_max_memory(max_memory)
        assert max_memory == {"cpu": 300 * 10**6} and result == {"cpu": 300 * 10**6}
        assert min(max_memory["cpu"], 10**9) == 300 * 10**6  # what transformers does with it


def accelerate_name(name):
    """An accelerate.utils name, or one only its modeling/offload modules have."""
    for module in (acc_utils, acc_utils.modeling, acc_utils.offload):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


def parameters(function):
    names = list(inspect.signature(function.__init__ if inspect.isclass(function) else function).parameters)
    return [n for n in names if n != "self"]


def test_modeling_helpers_give_accelerates_results():
    model = net()
    sizes = tb_utils.compute_module_sizes(model)
    for device_map in ({"embed": 0, "blocks.0.up": 0, "blocks.0.down": 0, "blocks.0.scale": 0, "blocks.1": "cpu"},
                       {"a.b": "cpu", "a.c": "cpu", "d": "disk"}, {"x": 1}):
        assert tb_utils.clean_device_map(dict(device_map)) == accelerate_name('clean_device_map')(dict(device_map))
    mapping = {"a.b": "cpu", "a.c": "cpu", "d": 0}
    assert tb_utils.clean_device_map(mapping) is mapping and mapping == {"a": "cpu", "d": 0}  # in place
    assert tb_utils.get_module_leaves(sizes) == acc_utils.modeling.get_module_leaves(sizes)
    assert tb_utils.get_non_persistent_buffers(model, recurse=True) == \
        acc_utils.modeling.get_non_persistent_buffers(model, recurse=True)
    assert tb_utils.compute_module_total_buffer_size(model) == \
        acc_utils.modeling.compute_module_total_buffer_size(model)
    modules = list(model.named_children())
    args = (["head.weight"], sizes["embed"], sizes, modules)
    theirs = acc_utils.modeling.get_module_size_with_ties(*args)
    assert tb_utils.get_module_size_with_ties(*args) == theirs
    layer = tb_utils.get_max_layer_size(modules, sizes, ["Block"])
    assert layer == acc_utils.get_max_layer_size(modules, sizes, ["Block"])
    assert tb_utils.convert_file_size_to_int("1.5GiB") == acc_utils.convert_file_size_to_int("1.5GiB")
    with pytest.raises(ValueError, match="shape") as on_accelerate:  # a value of another shape is refused
        acc_utils.set_module_tensor_to_device(model, "head.bias", "cpu", value=torch.zeros(3))
    with pytest.raises(ValueError, match="shape") as on_torchbay:  # with Accelerate's words (issue 36)
        tb_utils.set_module_tensor_to_device(model, "head.bias", "cpu", value=torch.zeros(3))
    assert str(on_torchbay.value) == str(on_accelerate.value)


def test_device_map_keys_sizes_and_bare_indexes_as_accelerate(tmp_path):
    """Found by running Accelerate 1.15's own tests/test_modeling_utils.py on torchbay."""
    model = net()
    for utils in (acc_utils, tb_utils):
        with pytest.warns(UserWarning, match="do not match any submodules.*'nowhere'"):
            utils.check_device_map(model, {"": "cpu", "nowhere": "cpu"})
        with pytest.raises(ValueError):
            utils.convert_file_size_to_int("-1GB")
    state = model.state_dict()
    files = {"embed": "part1.bin", "blocks": "part2.bin", "norm": "part3.bin", "head": "part3.bin"}
    weight_map = {name: files[name.split(".")[0]] for name in state}
    for file in set(files.values()):
        torch.save({k: v for k, v in state.items() if weight_map[k] == file}, tmp_path / file)
    (tmp_path / "weight_map.index.json").write_text(json.dumps(weight_map))  # a bare map, in a file of any name
    for top in (accelerate, torchbay):
        fresh = Net().eval()
        top.load_checkpoint_in_model(fresh, str(tmp_path))
        assert torch.equal(fresh(IDS), model(IDS))


# The accelerate.utils names transformers 5.25, peft 0.21 and diffusers 0.42 import for big-model work.
LIBRARY_NAMES = ["clean_device_map", "compute_module_sizes", "convert_file_size_to_int", "get_balanced_memory",
                 "get_max_layer_size", "get_max_memory", "infer_auto_device_map", "load_offloaded_weights",
                 "named_module_tensors", "offload_state_dict", "offload_weight", "save_offload_index",
                 "set_module_tensor_to_device", "get_module_size_with_ties", "load_offloaded_weight",
                 "OffloadedWeightsLoader", "PrefixedDataset", "align_module_device", "has_offloaded_params",
                 "get_state_dict_offloaded_model", "get_state_dict_from_offload", "find_tied_parameters",
                 "check_tied_parameters_on_same_device", "load_checkpoint_in_model", "load_state_dict",
                 "get_non_persistent_buffers", "compute_module_total_buffer_size", "check_device_map"]
HOOK_NAMES = ["ModelHook", "SequentialHook", "AlignDevicesHook", "CpuOffload", "UserCpuOffloadHook",
              "LayerwiseCastingHook", "add_hook_to_module", "remove_hook_from_module", "remove_hook_from_submodules",
              "attach_align_device_hook", "attach_align_device_hook_on_blocks", "attach_execution_device_hook"]


@pytest.mark.parametrize("name", LIBRARY_NAMES)
def test_every_modeling_helper_is_reachable_with_accelerates_parameters(name):
    theirs = parameters(accelerate_name(name))
    assert parameters(getattr(tb_utils, name))[:len(theirs)] == theirs


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_name_has_accelerates_parameters(name):
    assert parameters(getattr(tb_hooks, name)) == parameters(getattr(acc_hooks, name))
