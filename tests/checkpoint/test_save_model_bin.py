"""save_model(..., safe_serialization=False): torch's pytorch_model.bin files, as Accelerate writes them, with
torchbay's mark as a JSON record of each zip archive (read without unpickling), so that torchbay replaces only
its own weights files, in either format, and loaders never find two sets of weights."""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch
from safetensors.torch import save_file
from test_save_model_layout import TIES, accelerate_saves, build_model  # noqa: I001

from torchbay import Accelerator
from torchbay.checkpoint.model_folder import read_mark
from torchbay.errors import CheckpointError


def torchbay_saves(*pairs, safe_serialization=False):
    accelerator = Accelerator()
    model = accelerator.prepare(build_model())
    for folder, shard_size in zip(pairs[::2], pairs[1::2]):
        accelerator.save_model(model, str(folder), max_shard_size=shard_size, safe_serialization=safe_serialization)
    return model


def test_bin_files_hold_what_accelerates_hold_and_load_weights_only(tmp_path):
    acc, tb = tmp_path / "accelerate", tmp_path / "torchbay"
    accelerate_saves(acc / "single", "10GB:bin", acc / "sharded", "20KB:bin")
    model = torchbay_saves(tb / "single", "10GB", tb / "sharded", "20KB")
    for layout in ("single", "sharded"):
        names = sorted(os.listdir(acc / layout))
        assert sorted(os.listdir(tb / layout)) == names
        for name in names:
            if name.endswith(".json"):
                mine, theirs = (json.loads((f / layout / name).read_text()) for f in (tb, acc))
                assert mine["metadata"].pop("torchbay")["save"] and mine == theirs
                continue
            mine, theirs = (torch.load(f / layout / name, weights_only=True) for f in (tb, acc))
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
            assert read_mark(tb / layout / name)["save"] and read_mark(acc / layout / name) is None
    assert "pytorch_model.bin.index.json" in os.listdir(tb / "sharded") and len(os.listdir(tb / "sharded")) >= 4
    assert set(TIES) <= set(torch.load(tb / "single" / "pytorch_model.bin", weights_only=True))  # ties kept

    from torchbay.big_modeling.files import resolve_checkpoint

    for folder in (tb / "single", tb / "sharded"):
        assert resolve_checkpoint(folder).keys() == set(model.state_dict())


def test_saving_again_in_either_format_replaces_only_torchbays_own_weights(tmp_path):
    torchbay_saves(tmp_path, "20KB", tmp_path, "10GB")  # shards, then one .bin: no shard or index left
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]
    torchbay_saves(tmp_path, "10GB", safe_serialization=True)  # safetensors after torchbay's .bin: the .bin goes
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    torchbay_saves(tmp_path, "10GB")  # .bin after torchbay's safetensors: loaders would prefer it, so it goes
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]


def test_a_weights_file_torchbay_did_not_write_is_never_replaced(tmp_path):
    foreign_bin = tmp_path / "bin"
    foreign_bin.mkdir()
    torch.save({"w": torch.ones(2)}, foreign_bin / "pytorch_model.bin")
    before = (foreign_bin / "pytorch_model.bin").read_bytes()
    with pytest.raises(CheckpointError, match=r"holds pytorch_model.bin, which torchbay did not write .*Nothing was"):
        torchbay_saves(foreign_bin, "10GB")
    assert (foreign_bin / "pytorch_model.bin").read_bytes() == before and os.listdir(foreign_bin) == [
        "pytorch_model.bin"]
    torchbay_saves(foreign_bin, "10GB", safe_serialization=True)  # safetensors beside it: loaders prefer them
    assert sorted(os.listdir(foreign_bin)) == ["model.safetensors", "pytorch_model.bin"]
    assert (foreign_bin / "pytorch_model.bin").read_bytes() == before

    foreign_safetensors = tmp_path / "st"
    foreign_safetensors.mkdir()
    save_file({"w": torch.ones(2)}, str(foreign_safetensors / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="holds model.safetensors, which torchbay did not write"):
        torchbay_saves(foreign_safetensors, "10GB")  # a .bin beside it would never be loaded
    assert os.listdir(foreign_safetensors) == ["model.safetensors"]


def test_a_damaged_or_foreign_archive_is_not_taken_for_torchbays(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a zip")
    assert read_mark(tmp_path / "pytorch_model.bin") is None
    with zipfile.ZipFile(tmp_path / "other.bin", "w") as archive:
        archive.writestr("x/torchbay.json", "[1, 2]")  # a record of that name, not a mark
    assert read_mark(tmp_path / "other.bin") is None
