"""``save_model`` writes what Hugging Face Accelerate's ``save_model`` writes, file for file: the
same names, the same tensors under the same names, the same index, and no file of torchbay's own;
what torchbay needs to know rides in the files' metadata. Accelerate itself runs (in a
subprocess, the real library) on the same model, and both folders are compared."""

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torchbay import Accelerator
from torchbay.errors import CheckpointError

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = TESTS / "scripts" / "accelerate_save_model.py"
TIES = {"tied.weight": "0.weight", "tied.bias": "0.bias"}


def _build_model():
    spec = importlib.util.spec_from_file_location("accelerate_save_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines build_model only: its main part needs __main__
    return module.build_model


build_model = _build_model()


def accelerate_saves(*pairs):
    """Accelerate's save_model, one call per (folder, max_shard_size), in one subprocess."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("Hugging Face Accelerate is not installed here (pip install accelerate)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHBAY_", "ACCELERATE_"))}
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, pairs)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved with accelerate" in done.stdout


def torchbay_saves(*pairs):
    accelerator = Accelerator()
    model = accelerator.prepare(build_model())
    for folder, shard_size in zip(pairs[::2], pairs[1::2]):
        accelerator.save_model(model, str(folder), max_shard_size=shard_size)
    return model


def mark_of(metadata: dict) -> dict:
    return json.loads(metadata["torchbay"])


def assert_same_folder(ours: Path, theirs: Path) -> dict:
    """Same names; same tensors under the same names; the same index. Returns torchbay's entries."""
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    marks = {}
    for name in sorted(os.listdir(theirs)):
        if name.endswith(".safetensors"):
            with safe_open(str(ours / name), "pt") as mine, safe_open(str(theirs / name), "pt") as reference:
                assert sorted(mine.keys()) == sorted(reference.keys()), name
                for key in reference.keys():
                    assert torch.equal(mine.get_tensor(key), reference.get_tensor(key)), (name, key)
                assert reference.metadata() == {"format": "pt"}
                assert set(mine.metadata()) == {"format", "torchbay"} and mine.metadata()["format"] == "pt"
                marks[name] = mark_of(mine.metadata())
        else:
            assert name == "model.safetensors.index.json", name
            mine, reference = json.loads((ours / name).read_text()), json.loads((theirs / name).read_text())
            marks[name] = mine["metadata"].pop("torchbay")
            assert mine == reference
            # written alike: sorted keys, two-space indent, a newline at the end
            assert (theirs / name).read_text() == json.dumps(reference, indent=2, sort_keys=True) + "\n"
            mine["metadata"]["torchbay"] = marks[name]
            assert (ours / name).read_text() == json.dumps(mine, indent=2, sort_keys=True) + "\n"
    return marks


def test_single_file_sharded_and_sharded_then_single_are_what_accelerate_writes(tmp_path):
    acc, tb = tmp_path / "accelerate", tmp_path / "torchbay"
    accelerate_saves(acc / "single", "10GB", acc / "sharded", "20KB", acc / "again", "20KB", acc / "again", "10GB")
    model = torchbay_saves(tb / "single", "10GB", tb / "sharded", "20KB", tb / "again", "20KB", tb / "again", "10GB")

    marks = assert_same_folder(tb / "single", acc / "single")
    assert os.listdir(tb / "single") == ["model.safetensors"]
    assert marks["model.safetensors"]["aliases"] == TIES  # the tied names Accelerate drops, for torchbay's loader

    marks = assert_same_folder(tb / "sharded", acc / "sharded")
    shards = [n for n in marks if n.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in marks
    assert marks["model.safetensors.index.json"]["aliases"] == TIES
    assert {m["save"] for m in marks.values()} == {marks["model.safetensors.index.json"]["save"]}  # one save

    # sharded, then one file, into the same folder: exactly what that one-file call writes
    assert_same_folder(tb / "again", acc / "single")
    # (Accelerate 1.15 leaves the earlier shards and index beside it: its clean-up pattern never matches
    # .safetensors names; docs/checkpoint-guarantees.md names the difference)
    assert set(os.listdir(acc / "again")) > set(os.listdir(tb / "again"))

    # torchbay's loader reads both layouts back, tied weights included
    from torchbay.big_modeling.files import resolve_checkpoint

    for folder in (tb / "single", tb / "sharded", tb / "again"):
        files = resolve_checkpoint(folder)
        assert files.aliases == TIES and files.keys() == set(model.state_dict())


def test_one_file_then_shards_leave_no_single_file_for_a_loader_to_prefer(tmp_path):
    torchbay_saves(tmp_path, "10GB", tmp_path, "20KB")
    names = sorted(os.listdir(tmp_path))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert all(n.startswith("model-") or n == "model.safetensors.index.json" for n in names)


def test_other_files_are_kept_and_a_weights_file_torchbay_did_not_write_is_never_replaced(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden": 64}')  # saved by the user (or save_pretrained) first
    torchbay_saves(folder, "10GB")
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert (folder / "config.json").read_text() == '{"hidden": 64}'

    for foreign in ("model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        other = tmp_path / foreign.replace(".", "_")
        other.mkdir()
        if foreign.endswith(".json"):
            (other / foreign).write_text('{"metadata": {}, "weight_map": {}}')
        else:
            save_file({"w": torch.ones(2)}, str(other / foreign), metadata={"format": "pt"})  # as Accelerate does
        before = (other / foreign).read_bytes()
        with pytest.raises(CheckpointError, match=rf"holds {foreign}, which torchbay did not write .*Nothing was "
                                                  rf"written"):
            torchbay_saves(other, "10GB")
        assert os.listdir(other) == [foreign] and (other / foreign).read_bytes() == before

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        torchbay_saves(tmp_path / "a_file", "10GB")


def test_shards_of_two_saves_under_one_index_are_refused_on_load(tmp_path):
    from torchbay.big_modeling.files import resolve_checkpoint

    torchbay_saves(tmp_path / "a", "20KB", tmp_path / "b", "20KB")
    shutil.copy(tmp_path / "b" / "model-00002-of-00004.safetensors", tmp_path / "a")  # as a torn save leaves it
    with pytest.raises(CheckpointError, match="model-00002-of-00004.safetensors come from different saves"):
        resolve_checkpoint(tmp_path / "a")
    resolve_checkpoint(tmp_path / "b")


def test_temporaries_of_an_interrupted_save(tmp_path, caplog):
    torchbay_saves(tmp_path / "done", "10GB")
    shutil.copy(tmp_path / "done" / "model.safetensors", tmp_path / "done" / ".torchbay-tmp-1a2b-model.safetensors")
    (tmp_path / "done" / ".torchbay-tmp-3c4d-model.safetensors").write_bytes(b"\x08")  # cut short: unprovable
    caplog.set_level(logging.WARNING, logger="torchbay")
    torchbay_saves(tmp_path / "done", "10GB")
    assert sorted(os.listdir(tmp_path / "done")) == [".torchbay-tmp-3c4d-model.safetensors", "model.safetensors"]
    assert any(".torchbay-tmp-3c4d" in r.message and "remove it yourself" in r.message for r in caplog.records)


def test_a_save_that_changed_layout_and_was_interrupted_loads_its_own_files(tmp_path):
    """Both a single file and an index of torchbay's in one folder (the save that switched layout
    stopped before removing the other): torchbay's reader takes the newer save."""
    from torchbay.big_modeling.files import resolve_checkpoint

    torchbay_saves(tmp_path / "older_sharded", "20KB", tmp_path / "newer_single", "10GB")
    shutil.copy(tmp_path / "newer_single" / "model.safetensors", tmp_path / "older_sharded")
    assert [f.name for f in resolve_checkpoint(tmp_path / "older_sharded").files] == ["model.safetensors"]

    torchbay_saves(tmp_path / "older_single", "10GB", tmp_path / "newer_sharded", "20KB")
    for name in os.listdir(tmp_path / "newer_sharded"):
        shutil.copy(tmp_path / "newer_sharded" / name, tmp_path / "older_single")
    assert len(resolve_checkpoint(tmp_path / "older_single").files) == 4
