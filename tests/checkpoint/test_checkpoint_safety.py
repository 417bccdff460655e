"""Checkpoint guarantees in one process, on real files: nothing of the user's is deleted, an
interrupted save is recovered, damaged or forged files are refused, automatic naming never
overwrites. (Several processes, DCP, FSDP and DeepSpeed: test_checkpoint_processes.py.)"""

import json
import logging
import os
import pickle
from fractions import Fraction

import pytest
import torch
from safetensors.torch import load_file

from torchbay import Accelerator, CheckpointError, ProjectConfiguration
from torchbay.storage.files import file_record
from torchbay.storage.publish import MANIFEST, PARTIAL_MARKER, wait_for_removals


def build(**kwargs):
    acc = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def train(acc, model, opt):
    acc.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def tree(path):
    wait_for_removals()  # a replaced checkpoint is removed in the background
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def listing(path):
    wait_for_removals()
    return sorted(os.listdir(path))


def forge(directory, name, obj):
    """Replace a file and its manifest record: a consistent checkpoint made by someone else."""
    torch.save(obj, directory / name)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name] = file_record(directory / name)
    (directory / MANIFEST).write_text(json.dumps(manifest))


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --- never delete what torchbay did not write ------------------------------------------------


@pytest.fixture
def user_dir(tmp_path):
    out = tmp_path / "outputs"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "sub" / "data.csv").write_text("1,2")
    return out


def test_a_directory_of_user_files_is_refused_before_anything_is_written(tmp_path, user_dir):
    acc, model, opt = build()
    before = tree(tmp_path)
    with pytest.raises(CheckpointError,
                       match=r"outputs holds files that are not a torchbay checkpoint \(notes.txt, sub\)"):
        acc.save_state(str(user_dir))
    assert tree(tmp_path) == before and (user_dir / "notes.txt").read_text() == "my notes"
    # save_model writes beside other files, as Accelerate does (test_save_model_layout.py), and leaves them
    acc.save_model(model, str(user_dir))
    assert tree(tmp_path) == sorted([*before, "outputs/model.safetensors"])
    assert (user_dir / "notes.txt").read_text() == "my notes"


def test_the_current_directory_and_home_are_refused(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('my script')")
    monkeypatch.chdir(project)
    acc, model, opt = build()
    for target in (".", str(project), str(tmp_path)):
        with pytest.raises(CheckpointError, match="it is the current directory or one of its parents"):
            acc.save_state(target)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(CheckpointError, match="it is your home directory"):
        acc.save_state(os.path.expanduser("~"))
    assert tree(tmp_path) == ["home", "project", "project/train.py"]


def test_links_files_and_foreign_files_beside_a_checkpoint_are_refused(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    (tmp_path / "link").symlink_to(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="link is a symbolic link"):
        acc.save_state(str(tmp_path / "link"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file is a file, not a directory"):
        acc.save_state(str(tmp_path / "file"))
    (tmp_path / "ck" / "mine.txt").write_text("keep me")
    with pytest.raises(CheckpointError,
                       match=r"holds a torchbay checkpoint and also files torchbay did not write \(mine.txt\)"):
        acc.save_state(str(tmp_path / "ck"))
    assert (tmp_path / "ck" / "mine.txt").read_text() == "keep me" and (tmp_path / "file").read_text() == "x"
    assert listing(tmp_path) == ["ck", "file", "link"]


def test_an_empty_directory_and_an_earlier_checkpoint_are_replaced(tmp_path):
    acc, model, opt = build()
    (tmp_path / "empty").mkdir()
    acc.save_state(str(tmp_path / "empty"))
    first = snapshot(model)
    acc.save_state(str(tmp_path / "ck"))
    train(acc, model, opt)
    second = snapshot(model)
    acc.save_state(str(tmp_path / "ck"))  # replaces its own earlier checkpoint
    assert listing(tmp_path) == ["ck", "empty"]
    acc.load_state(str(tmp_path / "empty"))
    assert same(model, first)
    acc.load_state(str(tmp_path / "ck"))
    assert same(model, second)


def test_every_file_and_directory_is_fsynced_before_the_publishing_rename(tmp_path, monkeypatch):
    acc, model, opt = build()
    synced, real_fsync, real_rename = [], os.fsync, os.rename
    events = []

    def spy_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def spy_rename(self, target):
        events.append(("rename", str(self), str(target), list(synced)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(type(tmp_path), "rename", spy_rename)
    acc.save_state(str(tmp_path / "ck"))
    manifest = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    (_, src, dst, synced_before), = [e for e in events if e[2] == str(tmp_path / "ck")]
    partial = str(tmp_path / "ck.partial")
    assert src == partial
    for name in [*manifest["files"], MANIFEST]:
        assert f"{partial}/{name}" in synced_before, name
    assert partial in synced_before  # the directory entries too
    assert synced[-1] == str(tmp_path)  # and the parent after the rename


# --- an interrupted save ---------------------------------------------------------------------


def interrupted(tmp_path):
    """A crash between the two publishing renames: previous in ck.old, complete new in ck.partial."""
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    previous = snapshot(model)
    train(acc, model, opt)
    acc.save_state(str(tmp_path / "newer"))
    newer = snapshot(model)
    os.rename(tmp_path / "ck", tmp_path / "ck.old")
    os.rename(tmp_path / "newer", tmp_path / "ck.partial")
    return acc, model, opt, previous, newer


def test_a_crash_between_the_renames_is_named_by_load_and_finished_by_the_next_save(tmp_path):
    acc, model, opt, previous, newer = interrupted(tmp_path)
    with pytest.raises(CheckpointError, match=r"ck does not exist: a save was interrupted and the previous complete "
                                              r"checkpoint is in .*ck.old; load that path"):
        acc.load_state(str(tmp_path / "ck"))
    acc.load_state(str(tmp_path / "ck.old"))
    assert same(model, previous)
    train(acc, model, opt)
    latest = snapshot(model)
    acc.save_state(str(tmp_path / "ck"))  # publishes the interrupted save, then this one
    assert listing(tmp_path) == ["ck"]
    train(acc, model, opt)
    acc.load_state(str(tmp_path / "ck"))
    assert same(model, latest)


def test_an_unfinished_partial_is_removed_and_the_previous_checkpoint_kept(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    previous = snapshot(model)
    partial = tmp_path / "ck.partial"
    partial.mkdir()
    (partial / PARTIAL_MARKER).write_text("{}")
    (partial / "model_0.safetensors").write_bytes(b"half written")
    with pytest.raises(CheckpointError, match="not a complete torchbay checkpoint: torchbay_manifest.json is missing "
                                              r"\(it is an interrupted save\)"):
        acc.load_state(str(partial))
    train(acc, model, opt)
    acc.load_state(str(tmp_path / "ck"))
    assert same(model, previous)
    acc.save_state(str(tmp_path / "ck"))
    assert listing(tmp_path) == ["ck"]


def test_a_users_directory_with_torchbays_temporary_names_is_never_touched(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    for name in ("ck.partial", "ck.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("keep")
        with pytest.raises(CheckpointError, match=f"{name} .*move it away"):
            acc.save_state(str(tmp_path / "ck"))
        assert (tmp_path / name / "mine.txt").read_text() == "keep"
        os.remove(tmp_path / name / "mine.txt")
        os.rmdir(tmp_path / name)
    acc.load_state(str(tmp_path / "ck"))


# --- nothing is unpickled ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["optimizer_0.pt", "rng_state_0.pt", "training_state.pt", "precision.pt"])
def test_planted_code_in_any_file_never_runs(tmp_path, name):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    forge(tmp_path / "ck", name, {"state": Payload(tmp_path / "pwned")})
    with pytest.raises(CheckpointError, match=rf"{name} needs the class \w+\.system, which torchbay will not unpickle"):
        acc.load_state(str(tmp_path / "ck"))
    assert not (tmp_path / "pwned").exists()


def test_dcp_metadata_with_planted_code_is_refused(tmp_path):
    acc, model, opt = build(config={"checkpoint": {"io": "dcp"}})
    acc.save_state(str(tmp_path / "ck"))
    metadata_path = tmp_path / "ck" / "model_0" / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())  # test code: the file was just written here
    metadata.planner_data = Payload(tmp_path / "pwned")
    metadata_path.write_bytes(pickle.dumps(metadata))
    manifest = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    manifest["files"]["model_0/.metadata"] = file_record(metadata_path)
    (tmp_path / "ck" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError,
                       match=r"\.metadata needs the class \w+\.system, which torchbay will not unpickle"):
        acc.load_state(str(tmp_path / "ck"))
    assert not (tmp_path / "pwned").exists()


def test_the_plain_opt_out_loads_objects_the_safe_loader_refuses(tmp_path):
    class Progress:
        value = Fraction(1, 3)  # a harmless class outside torch's weights-only allow-list

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    for trust in (False, True):
        acc, model, opt = build(config={"checkpoint": {"allow_unsafe_pickle": trust}})
        progress = Progress()
        acc.register_for_checkpointing(progress)
        acc.save_state(str(tmp_path / f"ck{trust}"))
        progress.value = Fraction(0)
        if trust:
            acc.load_state(str(tmp_path / f"ck{trust}"))
            assert progress.value == Fraction(1, 3)
        else:
            with pytest.raises(CheckpointError, match="needs the class fractions.Fraction.*allow_unsafe_pickle: true"):
                acc.load_state(str(tmp_path / f"ck{trust}"))


# --- nothing damaged or stale is loaded ------------------------------------------------------------


def flip_bytes(path, count=16):
    data = bytearray(path.read_bytes())
    middle = len(data) - 64  # inside the tensor data, past the headers
    for i in range(count):
        data[middle - i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model_0.safetensors", "optimizer_0.pt"])
def test_flipped_bytes_are_named_and_nothing_is_loaded(tmp_path, name):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    train(acc, model, opt)
    current = snapshot(model)
    flip_bytes(tmp_path / "ck" / name)
    with pytest.raises(CheckpointError, match=rf"ck is damaged: {name} does not match its checksum"):
        acc.load_state(str(tmp_path / "ck"))
    assert same(model, current)  # nothing was changed
    acc2, model2, opt2 = build(config={"checkpoint": {"verify": False}})
    if name.endswith(".safetensors"):
        acc2.load_state(str(tmp_path / "ck"))  # the switch skips the check


def test_a_truncated_file_is_named(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    path = tmp_path / "ck" / "optimizer_0.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"optimizer_0.pt has 100 bytes, the manifest recorded \d+"):
        acc.load_state(str(tmp_path / "ck"))


def test_save_model_leaves_no_file_of_an_earlier_save(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))
    acc.save_model(model, str(tmp_path / "out"), max_shard_size="20KB")
    assert len([n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]) > 1
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.save_model(model, str(tmp_path / "out"))  # one file now: the old shards and index must go
    assert listing(tmp_path / "out") == ["model.safetensors"]
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_each_bad_manifest_gets_its_own_message(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    manifest = tmp_path / "ck" / MANIFEST
    good = manifest.read_text()
    cases = [
        (lambda: manifest.write_text("{not json"), "torchbay_manifest.json is not valid JSON"),
        (lambda: manifest.write_text(json.dumps({"format_version": 2})), "lacks the required field"),
        (lambda: manifest.write_text("[1, 2]"), "is not a torchbay manifest"),
        (lambda: (manifest.unlink(), manifest.mkdir()), "torchbay_manifest.json is a directory"),
    ]
    for damage, message in cases:
        damage()
        with pytest.raises(CheckpointError, match=message):
            acc.load_state(str(tmp_path / "ck"))
        if manifest.is_dir():
            manifest.rmdir()
        manifest.write_text(good)
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        acc.load_state(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        acc.load_state(str(tmp_path / "ck" / "optimizer_0.pt"))
    acc.load_state(str(tmp_path / "ck"))


# --- automatic naming and rotation -------------------------------------------------------------------


def auto(tmp_path, limit=2):
    return build(project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True,
                                                     total_limit=limit))


def test_a_new_run_continues_after_the_highest_checkpoint_and_rotation_keeps_the_newest(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    acc, model, opt = auto(tmp_path)
    acc.save_state()
    acc.save_state()
    assert listing(root) == ["checkpoint_0", "checkpoint_1"]
    caplog.set_level(logging.INFO, logger="torchbay")
    acc, model, opt = auto(tmp_path)  # a new run, same project
    train(acc, model, opt)
    newest = snapshot(model)
    acc.save_state()
    acc.save_state()
    assert listing(root) == ["checkpoint_2", "checkpoint_3"]
    continuing = [r.message for r in caplog.records if "saves from checkpoint_2 on" in r.message]
    assert len(continuing) == 1  # said once
    removed = [r.message for r in caplog.records if "removed the old checkpoint" in r.message]
    assert any("checkpoint_0" in m for m in removed) and any("checkpoint_1" in m for m in removed)
    acc, model, opt = auto(tmp_path)
    acc.load_state()  # the newest
    assert same(model, newest) and acc.save_iteration == 4


def test_rotation_never_deletes_a_foreign_or_other_projects_directory(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "checkpoint_0").mkdir(parents=True)
    (root / "checkpoint_0" / "mine.txt").write_text("keep")
    other_acc, _, _ = build()
    other_acc.save_state(str(root / "checkpoint_1"))  # another project's checkpoint (saved by path)
    acc, model, opt = auto(tmp_path, limit=1)
    for _ in range(3):
        acc.save_state()
    assert listing(root) == ["checkpoint_0", "checkpoint_1", "checkpoint_4"]
    assert (root / "checkpoint_0" / "mine.txt").read_text() == "keep"


def test_estimate_memory_counts_only_the_files_a_save_names(tmp_path):
    from safetensors.torch import save_file

    from torchbay.cli.estimate_memory import count_safetensors

    acc = Accelerator()
    model = acc.prepare(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))
    acc.save_model(model, str(tmp_path / "sharded"), max_shard_size="20KB")
    acc.save_model(model, str(tmp_path / "single"))
    expected = sum(p.numel() for p in model.parameters())
    for name in ("sharded", "single"):
        save_file({"stale": torch.zeros(1000)}, str(tmp_path / name / "model-stale.safetensors"))
        assert count_safetensors(tmp_path / name)["parameters"] == expected


def test_no_code_path_unpickles_outside_the_safe_loader():
    """Every pickle read of torchbay and its plugins goes through torchbay.storage.safe_load."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    pattern = re.compile(r"torch\.load\(|pickle\.loads?\(|weights_only\s*=\s*False|\bUnpickler\(")
    offenders = []
    for path in [*root.glob("core/torchbay/**/*.py"), *root.glob("plugins/**/*.py")]:
        if path.name == "safe_load.py" or "tests" in path.relative_to(root).parts:
            continue  # (a plugin's tests may read the files they wrote themselves)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and "weights_only=True" not in code:
                offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


class _Payload:
    """Stands for any class a pickle could name (and run code through)."""


def test_accelerates_utils_load_never_unpickles_arbitrary_classes(tmp_path):
    from torchbay.errors import ConfigError
    from torchbay.utils import load

    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    assert torch.equal(load(tmp_path / "plain.pt")["w"], torch.ones(2))
    torch.save({"obj": _Payload()}, tmp_path / "code.pt")  # a class of the test: needs arbitrary unpickling
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        load(tmp_path / "code.pt")
    with pytest.raises(ConfigError, match="refuses weights_only set to False"):
        load(tmp_path / "plain.pt", weights_only=False)


def test_a_forged_manifest_cannot_make_torchbay_read_or_remove_files_outside_the_checkpoint(tmp_path):
    acc, model, opt = build()
    acc.save_state(str(tmp_path / "ck"))
    (tmp_path / "victim.txt").write_text("keep")
    manifest = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    manifest["files"]["../victim.txt"] = file_record(tmp_path / "victim.txt")
    (tmp_path / "ck" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"lists file\(s\) outside the checkpoint directory \(../victim.txt\)"):
        acc.load_state(str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match="holds files that are not a torchbay checkpoint"):
        acc.save_state(str(tmp_path / "ck"))  # not a valid checkpoint any more: refused, not replaced
    assert (tmp_path / "victim.txt").read_text() == "keep"
