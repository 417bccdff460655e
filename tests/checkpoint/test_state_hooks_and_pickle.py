"""save_state(safe_serialization=False) and Accelerate's save-state / load-state pre-hooks (issue 36), the same
calls on Accelerate and on torchbay where the behaviour is shared."""

import json
import os
from pathlib import Path

import pytest
import torch

import torchbay
from torchbay.builtin.checkpoint_io import TorchCheckpointIO
from torchbay.errors import CheckpointError, ConfigError

accelerate = pytest.importorskip("accelerate", reason="Accelerate (a dev dependency) is the reference")
from accelerate.state import AcceleratorState as AccState  # noqa: E402


@pytest.fixture(params=["torchbay", "accelerate"])
def accelerator(request):
    if request.param == "torchbay":
        yield torchbay.Accelerator(cpu=True)
        return
    yield accelerate.Accelerator(cpu=True)
    AccState._reset_state(True)


def _models(accelerator, n=1):
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2) for _ in range(n)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    *models, opt = accelerator.prepare(*models, opt)
    return models, opt


def _scramble(*models):
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p.add_(1.0)


def test_pickle_save_state_round_trips(accelerator, tmp_path):
    (model,), _ = _models(accelerator)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.save_state(str(tmp_path / "ckpt"), safe_serialization=False)
    names = os.listdir(tmp_path / "ckpt")
    assert any(n.endswith(".bin") and "model" in n for n in names)
    assert not any(n.endswith(".safetensors") for n in names)
    _scramble(model)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_torchbay_pickle_checkpoint_holds_model_bin_and_is_read_weights_only(tmp_path):
    acc = torchbay.Accelerator(cpu=True)
    (model,), _ = _models(acc)
    acc.save_state(str(tmp_path / "ckpt"), safe_serialization=False)
    assert (tmp_path / "ckpt" / "model_0.bin").is_file()
    manifest = json.loads((tmp_path / "ckpt" / "torchbay_manifest.json").read_text())
    assert manifest["checkpoint_io"] == "torch" and "model_0.bin" in manifest["files"]
    acc.save_state(str(tmp_path / "safe"))  # the next save goes back to checkpoint.io
    assert (tmp_path / "safe" / "model_0.safetensors").is_file()

    torch.save({"weight": Payload()}, tmp_path / "evil.bin")
    with pytest.raises(CheckpointError):
        TorchCheckpointIO().load_state_dict(tmp_path, "evil")


class Payload:
    """A class the weights-only reader refuses to rebuild."""


def _hook_pair(log):
    def save_hook(models, weights, output_dir):
        log.append(("save", len(models), len(weights)))
        with open(os.path.join(output_dir, "data.json"), "w") as f:
            json.dump({"class_name": type(models[0]).__name__}, f)

    def load_hook(models, input_dir):
        log.append(("load", len(models)))
        with open(os.path.join(input_dir, "data.json")) as f:
            models[0].class_name = json.load(f)["class_name"]

    return save_hook, load_hook


def test_save_and_load_hooks_run_and_can_be_removed(accelerator, tmp_path):
    (model,), _ = _models(accelerator)
    log = []
    save_hook, load_hook = _hook_pair(log)
    handles = accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(load_hook)
    accelerator.save_state(str(tmp_path / "a"))
    assert (tmp_path / "a" / "data.json").is_file()  # published with the checkpoint
    model.class_name = "random"
    accelerator.load_state(str(tmp_path / "a"))
    assert model.class_name == "Linear" and log == [("save", 1, 1), ("load", 1)]
    for handle in handles:
        handle.remove()
    accelerator.save_state(str(tmp_path / "b"))
    accelerator.load_state(str(tmp_path / "b"))
    assert not (tmp_path / "b" / "data.json").exists() and len(log) == 2


def test_a_model_the_hooks_save_themselves_is_left_to_them(accelerator, tmp_path):
    (first, second), _ = _models(accelerator, n=2)
    second_before = {k: v.clone() for k, v in second.state_dict().items()}

    def save_second_myself(models, weights, output_dir):
        torch.save(weights.pop(), os.path.join(output_dir, "mine.pt"))  # as diffusers' scripts do

    def load_second_myself(models, input_dir):
        model = models.pop()
        model.load_state_dict(torch.load(os.path.join(input_dir, "mine.pt"), weights_only=True))

    accelerator.register_save_state_pre_hook(save_second_myself)
    accelerator.register_load_state_pre_hook(load_second_myself)
    accelerator.save_state(str(tmp_path / "c"))
    _scramble(first, second)
    accelerator.load_state(str(tmp_path / "c"))
    assert all(torch.equal(second_before[k], v) for k, v in second.state_dict().items())


def test_hook_files_are_part_of_the_torchbay_checkpoint(tmp_path):
    acc = torchbay.Accelerator(cpu=True)
    _models(acc)
    save_hook, _ = _hook_pair([])
    acc.register_save_state_pre_hook(save_hook)
    acc.save_state(str(tmp_path / "d"))
    manifest = json.loads((tmp_path / "d" / "torchbay_manifest.json").read_text())
    assert "data.json" in manifest["files"]  # checksummed, verified on load, removed with the checkpoint
    (tmp_path / "d" / "data.json").write_text("{}")
    with pytest.raises(CheckpointError, match="damaged"):
        acc.load_state(str(tmp_path / "d"))
    acc.save_state(str(tmp_path / "d"))  # torchbay replaces a checkpoint whose files it all wrote
    assert Path(tmp_path / "d" / "data.json").read_text() != "{}"


@pytest.mark.parametrize("side", ["torchbay", "accelerate"])
def test_register_for_checkpointing_names_each_invalid_item(side):
    acc = torchbay.Accelerator(cpu=True) if side == "torchbay" else accelerate.Accelerator(cpu=True)
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError) as info:
        acc.register_for_checkpointing(torch.tensor([1]), torch.tensor([2]), net, torch.optim.SGD(net.parameters()))
    assert "Item at index 0" in str(info.value) and "Item at index 1" in str(info.value)
    assert "Item at index 2" not in str(info.value)
    if side == "torchbay":
        assert isinstance(info.value, ConfigError)
    else:
        AccState._reset_state(True)
