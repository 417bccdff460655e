"""The checkpoint a save replaced is removed in a background thread; the next save to the same name does not wait
for that removal when it starts (it would stall on unlinking large files), only when it publishes and needs the
``.old`` name; a removal that failed is retried then. Real files, the real removal thread (held back by an event)."""

from __future__ import annotations

import threading

import pytest
import torch

import torchbay.storage.publish as publish
from torchbay import Accelerator
from torchbay.storage.publish import siblings, wait_for_removals


@pytest.fixture
def held_removals(monkeypatch):
    """Every background removal waits for ``release`` before it removes anything."""
    release = threading.Event()
    remove = publish._remove_in_background

    def held(old, final):
        release.wait(60)
        remove(old, final)

    monkeypatch.setattr(publish, "_remove_in_background", held)
    yield release
    release.set()
    wait_for_removals()


def removal_running() -> bool:
    return any(t.name == "torchbay-remove-old" and t.is_alive() for t in threading.enumerate())


def saved_twice(tmp_path):
    """A prepared model saved twice to one folder: the second save replaced the first, whose removal has started
    (held). Returns the accelerator, the model, the folder and the replaced checkpoint's ``.old`` name."""
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(64, 64))
    target = tmp_path / "ckpt"
    acc.save_state(target)
    acc.save_state(target)
    return acc, model, target, siblings(target)[1]


def test_a_save_does_not_wait_for_the_removal_of_what_the_last_save_replaced(tmp_path, held_removals):
    acc, model, target, old = saved_twice(tmp_path)
    assert old.is_dir() and removal_running()

    started = threading.Thread(target=publish.recover_interrupted_save, args=(target,))
    started.start()
    started.join(10)
    assert not started.is_alive(), "recover_interrupted_save waited for the removal of the replaced checkpoint"

    with torch.no_grad():
        model.weight.add_(1)
    expected = model.weight.detach().clone()
    handle = acc.save_state(target, blocking=False)  # starts while the removal is still held
    assert old.is_dir() and not handle.done()  # publishing needs the .old name: it waits for the removal
    held_removals.set()
    handle.wait()
    wait_for_removals()
    assert not old.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(target)
    assert torch.equal(model.weight, expected)  # the newest save is the one published
    acc.end_training()


def test_a_removal_that_fails_while_the_next_save_runs_is_retried_when_it_publishes(tmp_path, held_removals,
                                                                                      monkeypatch, caplog):
    acc, model, target, old = saved_twice(tmp_path)
    remove = publish.remove_own_checkpoint
    failures = []

    def fail_once(directory, why):
        if not failures:
            failures.append(directory)
            raise OSError("disk busy")
        remove(directory, why)

    monkeypatch.setattr(publish, "remove_own_checkpoint", fail_once)
    with torch.no_grad():
        model.weight.add_(1)
    expected = model.weight.detach().clone()
    handle = acc.save_state(target, blocking=False)  # starts while the removal runs
    held_removals.set()  # ... which then fails
    handle.wait()  # the publish removes the stale checkpoint itself, then replaces the current one
    wait_for_removals()
    assert failures == [old] and "could not remove" in caplog.text
    assert not old.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(target)
    assert torch.equal(model.weight, expected)
    acc.end_training()


def test_end_training_waits_for_the_removal_of_what_a_save_replaced(tmp_path, held_removals):
    acc, model, target, old = saved_twice(tmp_path)
    ended = threading.Thread(target=acc.end_training)
    ended.start()
    ended.join(1)
    assert ended.is_alive() and old.is_dir(), "end_training returned while the replaced checkpoint was being removed"
    held_removals.set()
    ended.join(30)
    assert not ended.is_alive() and not old.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing of torchbay's changes after it returns
