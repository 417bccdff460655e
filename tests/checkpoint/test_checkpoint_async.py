"""save_state(blocking=False): the state at the call, written in the background, with the
guarantees of a synchronous save (real files, real processes, real gloo groups)."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from torchbay import Accelerator, CheckpointError, ProjectConfiguration
from torchbay.checkpoint.async_save import AsyncSave
from torchbay.storage import files as ckfiles
from torchbay.storage import publish as ckdir
from torchbay.testing.processes import run_python, run_torchrun


class Gate:
    """Holds torchbay's background writer at its first write until ``open()`` (in this process)."""

    def __init__(self, monkeypatch):
        self.opened = threading.Event()
        self.reached = threading.Event()
        original = ckfiles.RecordingWriter.write

        def write(writer, data):
            if threading.current_thread() is not threading.main_thread():
                self.reached.set()
                assert self.opened.wait(60), "the test never opened the gate"
            return original(writer, data)

        monkeypatch.setattr(ckfiles.RecordingWriter, "write", write)

    def open(self):
        self.opened.set()


def setup(**kwargs):
    acc = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def step(acc, model, opt, sched):
    acc.backward(model(torch.randn(3, 16)).pow(2).mean())
    opt.step()
    sched.step()
    opt.zero_grad()


class Counter:
    def __init__(self):
        self.n = torch.zeros(3)

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n.copy_(state["n"])


def snapshot(model, opt, sched, counter):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            sched.get_last_lr(), counter.n.clone(), torch.get_rng_state())


def assert_equal_state(model, opt, sched, counter, expected):
    weights, states, lr, n, rng = snapshot(model, opt, sched, counter)
    assert all(torch.equal(weights[k], expected[0][k]) for k in weights)
    assert all(torch.equal(states[i][k], expected[1][i][k]) for i in states for k in states[i])
    assert lr == expected[2] and torch.equal(n, expected[3]) and torch.equal(rng, expected[4])


def test_the_checkpoint_is_the_state_at_the_call_while_training_changes_every_tensor(tmp_path, monkeypatch):
    acc, model, opt, sched = setup()
    counter = Counter()
    acc.register_for_checkpointing(counter)
    step(acc, model, opt, sched)
    gate = Gate(monkeypatch)
    expected = snapshot(model, opt, sched, counter)
    step_at_call = acc.gradient_state.step
    handle = acc.save_state(str(tmp_path / "ck"), blocking=False)
    assert isinstance(handle, AsyncSave) and os.fspath(handle) == str(tmp_path / "ck")
    assert gate.reached.wait(30) and not handle.done()
    for _ in range(3):  # every weight, optimizer state, scheduler, registered object and the RNG move on
        step(acc, model, opt, sched)
    counter.n += 5
    assert not (tmp_path / "ck").exists()  # nothing is published before its files are written
    gate.open()
    assert handle.wait() == str(tmp_path / "ck") and handle.done()
    after = snapshot(model, opt, sched, counter)
    assert not torch.equal(after[0]["0.weight"], expected[0]["0.weight"])
    acc.load_state(str(tmp_path / "ck"))
    assert_equal_state(model, opt, sched, counter, expected)
    manifest = json.loads((tmp_path / "ck" / ckdir.MANIFEST).read_text())
    assert manifest["step"] == step_at_call != acc.gradient_state.step + 3 and "optimizer_0.pt" in manifest["files"]


def test_the_staging_buffer_is_reused_and_a_second_save_waits_for_the_first(tmp_path, monkeypatch):
    acc, model, opt, sched = setup()
    step(acc, model, opt, sched)
    first = acc.save_state(str(tmp_path / "a"), blocking=False)
    buffers = {id(t) for t in acc._checkpointer._stage._buffers.values()}
    first.wait()
    step(acc, model, opt, sched)
    expected = snapshot(model, opt, sched, Counter())
    gate = Gate(monkeypatch)
    first = acc.save_state(str(tmp_path / "a"), blocking=False)
    assert gate.reached.wait(30) and not first.done()
    threading.Timer(0.5, gate.open).start()
    second = acc.save_state(str(tmp_path / "a"), blocking=False)  # the same folder: never two writers on it
    assert first.done()  # the second call returned only once the first was published
    third = acc.save_state(str(tmp_path / "b"), blocking=False)
    assert second.done() and {id(t) for t in acc._checkpointer._stage._buffers.values()} == buffers
    third.wait()
    for path in ("a", "b"):
        step(acc, model, opt, sched)
        acc.load_state(str(tmp_path / path))
        assert_equal_state(model, opt, sched, Counter(), expected[:3] + (torch.zeros(3), expected[4]))
    assert not any(p.name.endswith((".partial", ".old")) for p in tmp_path.iterdir())


def test_load_state_and_end_training_wait_for_a_save_in_flight(tmp_path, monkeypatch):
    acc, model, opt, sched = setup()
    step(acc, model, opt, sched)
    acc.save_state(str(tmp_path / "ck"))
    expected = snapshot(model, opt, sched, Counter())
    step(acc, model, opt, sched)
    gate = Gate(monkeypatch)
    handle = acc.save_state(str(tmp_path / "ck"), blocking=False)  # replaces ck once written
    assert gate.reached.wait(30)
    threading.Timer(0.3, gate.open).start()
    acc.load_state(str(tmp_path / "ck"))  # waits: loads the new checkpoint, not the one it replaces
    assert handle.done()
    assert not torch.equal(model.state_dict()["0.weight"], expected[0]["0.weight"])
    handle = acc.save_state(str(tmp_path / "end"), blocking=False)
    acc.end_training()
    assert handle.done() and (tmp_path / "end" / ckdir.MANIFEST).is_file()


def thread_can_lower_its_priority() -> bool:
    """Whether this machine lets a thread lower its own CPU priority (a sandbox may refuse setpriority)."""
    if not sys.platform.startswith("linux"):
        return False
    outcome = []

    def probe():
        me = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + 1)
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return outcome == [True]


@pytest.mark.skipif(not thread_can_lower_its_priority(),
                    reason="a thread cannot lower its own CPU priority here (Linux only; a sandbox may refuse it)")
@pytest.mark.parametrize("nice", [None, 0, 19])
def test_the_background_writer_runs_below_the_loops_priority(tmp_path, monkeypatch, nice):
    gate = Gate(monkeypatch)
    acc, model, opt, sched = setup(**({} if nice is None else {"config": {"checkpoint.async_writer_nice": nice}}))
    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    handle = acc.save_state(str(tmp_path / "ckpt"), blocking=False)
    assert gate.reached.wait(60)
    writer = next(t for t in threading.enumerate() if t.name.startswith("torchbay-save-"))
    assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(loop + (10 if nice is None else nice), 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop  # the loop's own is unchanged
    gate.open()
    handle.wait()
    acc.end_training()


def test_a_failed_background_write_is_raised_by_wait_and_publishes_nothing(tmp_path):
    acc, model, opt, sched = setup()

    class Unpicklable:
        def state_dict(self):
            return {"f": lambda: None}  # torch.save cannot pickle it: fails in the writer thread

        def load_state_dict(self, state):
            pass

    acc.register_for_checkpointing(Unpicklable())
    handle = acc.save_state(str(tmp_path / "ck"), blocking=False)
    with pytest.raises(CheckpointError, match="save_state to .*ck failed"):
        handle.wait()
    assert handle.done() and not (tmp_path / "ck").exists() and not (tmp_path / "ck.partial").exists()
    with pytest.raises(CheckpointError):  # the error is kept: asking again tells it again
        handle.wait()


def test_automatic_async_checkpoints_rotate_only_after_the_new_one_is_published(tmp_path, monkeypatch):
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc, model, opt, sched = setup(project_config=project)
    acc.config.checkpoint.async_save = True
    for _ in range(2):
        step(acc, model, opt, sched)
        handle = acc.save_state()
        assert isinstance(handle, AsyncSave)  # checkpoint.async_save: automatic saves are async
    handle.wait()
    root = tmp_path / "checkpoints"
    gate = Gate(monkeypatch)
    step(acc, model, opt, sched)
    handle = acc.save_state()
    assert gate.reached.wait(30)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "checkpoint_1", "checkpoint_2.partial"]
    gate.open()
    handle.wait()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert acc.save_iteration == 3


def test_an_explicit_directory_stays_synchronous_with_async_save_on(tmp_path):
    acc, model, opt, sched = setup()
    acc.config.checkpoint.async_save = True
    assert acc.save_state(str(tmp_path / "ck")) == str(tmp_path / "ck")  # a str, as today
    assert (tmp_path / "ck" / ckdir.MANIFEST).is_file()


def test_sigkill_during_the_background_write_loses_nothing_published(tmp_path, script):
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, script("async_save_worker.py"), "--mode", "kill", "--ckpt", str(ckpt),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "HELD", proc.stderr.read() if proc.poll() is not None else line
        assert (ckpt / "second.partial").is_dir()  # the background write is running
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert sorted(p.name for p in ckpt.iterdir()) == ["first", "second", "second.partial"]
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.load_state(str(ckpt / "first"))
    acc.load_state(str(ckpt / "second"))  # the checkpoint the killed save was replacing is intact
    with pytest.raises(CheckpointError, match="interrupted save"):
        acc.load_state(str(ckpt / "second.partial"))
    acc.save_state(str(ckpt / "second"), blocking=False).wait()  # the next save clears the unfinished one
    ckdir.wait_for_removals()  # the replaced checkpoint is unlinked beside training, as after any save
    assert sorted(p.name for p in ckpt.iterdir()) == ["first", "second"]


def test_interpreter_exit_waits_for_the_background_write(tmp_path, script):
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    run = run_python(script("async_save_worker.py"), ["--mode", "exit", "--ckpt", str(ckpt), "--out", str(out)],
                     timeout=240).check()
    assert "LEFT False" in run.stdout  # the script ended while the writer was still at work
    assert (ckpt / "at_exit" / ckdir.MANIFEST).is_file() and not (ckpt / "at_exit.partial").exists()
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.load_state(str(ckpt / "at_exit"))
    weights, _ = torch.load(out / "expected.pt", weights_only=True)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_strategy_without_background_saves_warns_once_and_saves_synchronously(tmp_path, caplog, monkeypatch):
    acc, model, opt, sched = setup()
    monkeypatch.setattr(type(acc.strategy), "async_checkpoint", False)
    with caplog.at_level(logging.WARNING, logger="torchbay"):
        first = acc.save_state(str(tmp_path / "a"), blocking=False)
        acc.save_state(str(tmp_path / "b"), blocking=False)
    assert first.done() and first.wait() == str(tmp_path / "a") and (tmp_path / "a" / ckdir.MANIFEST).is_file()
    warnings = [r for r in caplog.records if "saves synchronously here" in r.getMessage()]
    assert len(warnings) == 1 and "single strategy" in warnings[0].getMessage()


@pytest.mark.multiprocess
def test_two_ranks_publish_together_and_a_failure_on_one_rank_is_an_error_on_both(tmp_path, script):
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    run_torchrun(script("async_save_worker.py"), 2, ["--mode", "ranks", "--ckpt", str(ckpt), "--out", str(out)],
                 timeout=300).check()
    ranks = [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world"] == 2 and r["changed"] and r["equal_at_call"]
        assert not r["done_before_wait"] and r["done_after_wait"]  # published at the agreement, in wait()
        assert r["error"] and "save_state failed on rank 1" in r["error"] and "injected on rank 1" in r["error"]
        assert not r["bad_exists"] and not r["bad_partial_exists"]
        assert r["last_done"] and r["last_published"]
    manifest = json.loads((ckpt / "good" / ckdir.MANIFEST).read_text())
    assert {"rng_state_0.pt", "rng_state_1.pt", "optimizer_0.pt"} <= set(manifest["files"])


@pytest.mark.multiprocess
def test_fsdp2_saves_in_the_background_with_dcp_async_save(tmp_path, script):
    pytest.importorskip("torchbay_fsdp")
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    run_torchrun(script("async_save_worker.py"), 2, ["--mode", "fsdp", "--ckpt", str(ckpt), "--out", str(out)],
                 timeout=300).check()
    for r in (json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)):
        assert not r["done_at_return"] and r["changed"] and r["equal_at_call"] and r["published"]
        assert r["warnings"] == []
    manifest = json.loads((ckpt / "a" / ckdir.MANIFEST).read_text())
    assert (any(name.startswith("fsdp_model_0/__1_") for name in manifest["files"])
            and "rng_state_1.pt" in manifest["files"])


def test_the_staging_buffer_keeps_ties_and_metadata_and_reuses_its_tensors():
    from torchbay.checkpoint.async_save import StagingBuffer

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    stage = StagingBuffer(pin_memory=False)
    stage.begin()
    copy = stage.copy(model.state_dict(), "m")
    stage.finish(lambda: None)
    assert copy["0.weight"] is copy["1.weight"] and copy["0.weight"].data_ptr() != model[0].weight.data_ptr()
    assert copy._metadata == model.state_dict()._metadata and torch.equal(copy["0.weight"], model[0].weight)
    before = copy["0.weight"]
    with torch.no_grad():
        model[0].weight.add_(1)
    stage.begin()
    again = stage.copy(model.state_dict(), "m")
    stage.finish(lambda: None)
    assert again["0.weight"] is before and torch.equal(before, model[0].weight)  # reused, refreshed
    stage.begin()
    other = stage.copy({"0.weight": torch.ones(3)}, "m")  # a new shape: a new buffer, the old one dropped
    stage.finish(lambda: None)
    assert other["0.weight"] is not before and stage.nbytes() == 12
