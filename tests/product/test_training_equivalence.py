"""Through the public API: DDP on 2 gloo processes equals 1 process on the same global
batches, and save_state / load_state in a new process resumes exactly (weights and batch
order), with gradient accumulation and a shuffled loader."""

import json

import pytest
import torch

from torchbay.testing.processes import run_python, run_torchrun

pytestmark = pytest.mark.multiprocess


def _load(prefix, world):
    return [json.load(open(f"{prefix}.rank{r}.json")) for r in range(world)]


def _assert_weights_close(a, b, atol):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), atol=atol, rtol=0, msg=key)


def test_two_process_ddp_matches_one_process(tmp_path, script):
    # the same global order at 1 and 2 processes needs use_seedable_sampler, as on Accelerate: without it a
    # multi-process loader shuffles with a generator drawn at prepare (issue 36: Accelerate's order)
    common = ["--steps", "10", "--seedable-sampler"]
    run_python(script("core_train.py"), ["--out", str(tmp_path / "single"), "--batch-size", "8", *common]).check()
    run_torchrun(script("core_train.py"), 2, ["--out", str(tmp_path / "ddp"), "--batch-size", "4", *common]).check()
    (single,) = _load(tmp_path / "single", 1)
    ddp0, ddp1 = _load(tmp_path / "ddp", 2)
    assert ddp0["world"] == 2 and ddp0["strategy"] == "ddp" and single["strategy"] == "single"
    # the two ranks together saw exactly the single process's global batches
    for step, batch in enumerate(single["seen"]):
        assert sorted(ddp0["seen"][step] + ddp1["seen"][step]) == sorted(batch)
        assert not set(ddp0["seen"][step]) & set(ddp1["seen"][step])
    _assert_weights_close(ddp0["weights"], ddp1["weights"], atol=0)
    _assert_weights_close(single["weights"], ddp0["weights"], atol=1e-5)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: three 2-process launches
def test_resume_mid_epoch_is_exact(tmp_path, script, world):
    # 40 samples, batch 4 (x world) -> 10 (5) micro-batches per epoch: stop mid-epoch 2
    steps, stop = (16, 12) if world == 1 else (9, 7)
    # dropout draws from the global RNG: resume must restore it and data loading must not disturb it
    common = ["--ga", "2", "--steps", str(steps), "--batch-size", "4", "--dropout", "0.2"]
    run = (lambda a: run_python(script("core_train.py"), a)) if world == 1 else \
        (lambda a: run_torchrun(script("core_train.py"), 2, a))
    run(common + ["--out", str(tmp_path / "full")]).check()
    ckpt = str(tmp_path / "ckpt")
    run(common + ["--phase", "first", "--stop-at", str(stop), "--ckpt", ckpt, "--out", str(tmp_path / "a")]).check()
    run(common + ["--phase", "resume", "--ckpt", ckpt, "--out", str(tmp_path / "b")]).check()
    for rank in range(world):
        full = _load(tmp_path / "full", world)[rank]
        first = _load(tmp_path / "a", world)[rank]
        resumed = _load(tmp_path / "b", world)[rank]
        assert len(first["seen"]) == stop
        assert first["seen"] + resumed["seen"] == full["seen"], "resumed run served different batches"
        _assert_weights_close(full["weights"], resumed["weights"], atol=0)


@pytest.mark.slow
def test_a_one_process_checkpoint_loads_into_two_processes(tmp_path, script):
    ckpt = str(tmp_path / "ckpt")
    common = ["--steps", "8", "--batch-size", "4"]
    run_python(script("core_train.py"), common + ["--phase", "first", "--stop-at", "4", "--ckpt", ckpt,
                                                  "--out", str(tmp_path / "a")]).check()
    result = run_torchrun(script("core_train.py"), 2, common + ["--phase", "resume", "--ckpt", ckpt,
                                                                "--out", str(tmp_path / "b")]).check()
    assert "resumes with the RNG state of rank 0" in result.stderr
    first = _load(tmp_path / "a", 1)[0]
    r0, r1 = _load(tmp_path / "b", 2)
    _assert_weights_close(r0["weights"], r1["weights"], atol=0)  # DDP kept the loaded weights in sync
    assert r0["weights"] != first["weights"]  # and training went on from them
