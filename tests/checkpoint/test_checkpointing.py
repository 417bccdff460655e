"""save_state / load_state: atomic directories, rotation, safe loading, parts named on failure."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from torchbay import Accelerator, CheckpointError, ProjectConfiguration
from torchbay.storage.files import file_record
from torchbay.storage.publish import MANIFEST


def rewrite(directory, name, obj):
    """Replace one file of a checkpoint and its manifest record, as a consistent (forged) checkpoint would."""
    torch.save(obj, directory / name)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name] = file_record(directory / name)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def setup(**kwargs):
    acc = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def step(acc, model, opt, sched):
    acc.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()
    sched.step()
    opt.zero_grad()


def test_round_trip_restores_everything(tmp_path):
    acc, model, opt, sched = setup()
    step(acc, model, opt, sched)
    acc.save_state(str(tmp_path / "ck"))
    expected_weights = {k: v.clone() for k, v in model.state_dict().items()}
    expected_lr = sched.get_last_lr()
    expected_random = torch.rand(3)
    step(acc, model, opt, sched)
    acc.load_state(str(tmp_path / "ck"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected_weights[k])
    assert sched.get_last_lr() == expected_lr
    assert torch.equal(torch.rand(3), expected_random)  # RNG restored
    manifest = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    assert (manifest["world_size"] == 1 and manifest["strategy"] == "single"
            and "model_0.safetensors" in manifest["files"])
    assert manifest["config"]["mixed_precision"] == "no" and "cpu" in manifest["plugins"]


def test_a_crash_mid_save_leaves_nothing_that_loads(tmp_path, monkeypatch):
    acc, model, opt, sched = setup()
    acc.save_state(str(tmp_path / "ck"))
    good = {k: v.clone() for k, v in model.state_dict().items()}
    step(acc, model, opt, sched)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(acc.precision, "state_dict", boom)
    with pytest.raises(CheckpointError, match="save_state failed: OSError: disk full"):
        acc.save_state(str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the unfinished save is gone, the previous one untouched
    monkeypatch.undo()
    acc.load_state(str(tmp_path / "ck"))  # the previous complete checkpoint is intact
    for k, v in model.state_dict().items():
        assert torch.equal(v, good[k])


def test_automatic_naming_and_rotation_keep_the_newest(tmp_path):
    acc, model, opt, sched = setup(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    for _ in range(4):
        step(acc, model, opt, sched)
        acc.save_state()
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["checkpoint_2", "checkpoint_3"]
    acc.load_state()
    assert acc.save_iteration == 4


def test_missing_part_is_named(tmp_path):
    acc, model, opt, sched = setup()
    acc.save_state(str(tmp_path / "ck"))
    os.remove(tmp_path / "ck" / "scheduler_0.pt")
    with pytest.raises(CheckpointError, match="is incomplete: scheduler_0.pt is missing"):
        acc.load_state(str(tmp_path / "ck"))


def test_broken_rng_state_raises_instead_of_logging(tmp_path):
    acc, model, opt, sched = setup()
    acc.save_state(str(tmp_path / "ck"))
    state = torch.load(tmp_path / "ck" / "rng_state_0.pt", weights_only=True)
    state["torch"] = torch.zeros(3, dtype=torch.uint8)
    rewrite(tmp_path / "ck", "rng_state_0.pt", state)
    with pytest.raises(CheckpointError, match="RNG state part 'torch'"):
        acc.load_state(str(tmp_path / "ck"))


def test_pickled_code_is_never_executed(tmp_path):
    acc, model, opt, sched = setup()
    acc.save_state(str(tmp_path / "ck"))

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    rewrite(tmp_path / "ck", "scheduler_0.pt", {"evil": Evil()})
    with pytest.raises(CheckpointError,
                       match=r"scheduler_0.pt needs the class \w+.system, which torchbay will not unpickle"):
        acc.load_state(str(tmp_path / "ck"))
    assert not (tmp_path / "pwned").exists()


def test_mismatched_objects_are_refused(tmp_path):
    acc, model, opt, sched = setup()
    acc.save_state(str(tmp_path / "ck"))
    acc2 = Accelerator()
    acc2.prepare(torch.nn.Linear(4, 2))
    with pytest.raises(CheckpointError, match="optimizers: checkpoint has 1, this run prepared 0"):
        acc2.load_state(str(tmp_path / "ck"))


def test_wrong_shapes_name_the_model(tmp_path):
    acc, model, opt, sched = setup()
    acc.save_state(str(tmp_path / "ck"))
    acc2 = Accelerator()
    m = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.ReLU(), torch.nn.Linear(9, 2))
    o = torch.optim.AdamW(m.parameters())
    acc2.prepare(m, o, torch.optim.lr_scheduler.StepLR(o, 1))
    with pytest.raises(CheckpointError, match="model 0 .* does not fit"):
        acc2.load_state(str(tmp_path / "ck"))


def test_save_model_shards_and_loads_into_the_plain_model(tmp_path):
    acc = Accelerator()
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    model.tied = model[0]  # shared weights are written once
    prepared = acc.prepare(model)
    files = acc.save_model(prepared, str(tmp_path / "out"), max_shard_size="20KB")
    assert "model.safetensors.index.json" in files and len(files) > 2
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    state = {}
    for shard in set(index["weight_map"].values()):
        state.update(load_file(str(tmp_path / "out" / shard)))
    for alias, target in index["metadata"]["torchbay"]["aliases"].items():  # torchbay's entry: Accelerate drops ties
        state[alias] = state[target]
    fresh = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    fresh.tied = fresh[0]
    fresh.load_state_dict(state)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_register_for_checkpointing_needs_state_dict():
    from torchbay import TorchbayError

    with pytest.raises(TorchbayError, match="state_dict"):
        Accelerator().register_for_checkpointing(object())
