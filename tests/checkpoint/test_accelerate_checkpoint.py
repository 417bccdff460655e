"""load_state reads a folder the real Accelerate's save_state wrote (issue 25: a user moving mid-training).

The same short loop (tests/scripts/accelerate_ckpt_loop.py: a model with dropout, AdamW, StepLR, a prepared loader,
a registered object, draws from python/numpy/torch RNGs) runs on Accelerate 1.15, saves its state after 4 steps
and continues; torchbay loads that folder into objects built with other initial weights and continues with the
same losses, the same learning rate and the registered object's count. Refusals: an RNG pickle that asks for
any class outside the allow-list (nothing runs), Accelerate's data-loader files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from torchbay.testing.processes import run_python, run_torchrun

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "accelerate_ckpt_loop.py")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="the real Accelerate is not installed")
ENV = {"TORCHBAY_AS_ACCELERATE": "0"}


def _saved(tmp: Path, processes: int) -> tuple[Path, dict]:
    ckpt, result = tmp / "ckpt", tmp / "accelerate_save.json"
    args = ["save", str(ckpt), str(result), "--backend", "accelerate"]
    run = run_python(SCRIPT, args, env=ENV, timeout=240) if processes == 1 else \
        run_torchrun(SCRIPT, processes, args, env=ENV, timeout=240)
    run.check()
    return ckpt, json.loads(result.read_text())


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory) -> tuple[Path, dict]:
    """One 1-process Accelerate save for the whole module (each run costs an Accelerate start-up)."""
    return _saved(tmp_path_factory.mktemp("accelerate_save"), 1)


def _copy_of(saved: tuple[Path, dict], tmp: Path) -> tuple[Path, dict]:
    """The shared 1-process save, copied into this test's folder: the test may change its copy."""
    ckpt, result = saved
    shutil.copytree(ckpt, tmp / "ckpt")
    return tmp / "ckpt", result


def _resume(tmp: Path, ckpt: Path, processes: int, backend: str = "torchbay"):
    result = tmp / f"{backend}_resume.json"
    args = ["resume", str(ckpt), str(result), "--backend", backend]
    run = run_python(SCRIPT, args, env=ENV, timeout=240) if processes == 1 else \
        run_torchrun(SCRIPT, processes, args, env=ENV, timeout=240)
    return run, (json.loads(result.read_text()) if result.is_file() else None)


@pytest.mark.parametrize("processes", [1, 2])
def test_torchbay_resumes_an_accelerate_checkpoint_with_accelerates_losses(tmp_path, processes, request):
    ckpt, saved = _copy_of(request.getfixturevalue("saved_once"), tmp_path) if processes == 1 else \
        _saved(tmp_path, processes)
    assert sorted(os.listdir(ckpt)) == sorted(["custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin",
                                               "scheduler.bin", *[f"random_states_{r}.pkl" for r in range(processes)]])
    run, resumed = _resume(tmp_path, ckpt, processes)
    run.check()
    assert resumed["rest"] == saved["rest"]  # bit for bit: weights, AdamW moments, dropout masks, RNG draws
    assert resumed["lr"] == saved["lr"] and resumed["seen"] == saved["seen"] == 10
    if processes == 1:  # Accelerate resuming its own checkpoint gives the same numbers
        _, theirs = _resume(tmp_path, ckpt, processes, backend="accelerate")
        assert theirs["rest"] == resumed["rest"]


def test_an_rng_pickle_outside_the_allow_list_is_refused_and_runs_nothing(tmp_path, saved_once):
    ckpt, _ = _copy_of(saved_once, tmp_path)
    marker = tmp_path / "code_ran"
    code = ("import os, torch\n"
            "class Evil:\n"
            f"    def __reduce__(self): return (os.system, ('touch {marker}',))\n"
            f"torch.save({{'step': 0, 'random_state': Evil()}}, {str(ckpt / 'random_states_0.pkl')!r})\n")
    run_python_code(code)
    run, resumed = _resume(tmp_path, ckpt, 1)
    assert run.returncode != 0 and resumed is None
    assert "random_states_0.pkl needs the class posix.system, which torchbay will not unpickle" in run.stderr
    assert not marker.exists()


def test_accelerates_data_loader_files_are_refused_naming_them(tmp_path, saved_once):
    ckpt, _ = _copy_of(saved_once, tmp_path)
    shutil.copy(ckpt / "scheduler.bin", ckpt / "sampler.bin")
    run, _ = _resume(tmp_path, ckpt, 1)
    assert run.returncode != 0
    assert "sampler.bin holds Accelerate's data-loader state" in run.stderr and "skip_first_batches" in run.stderr


def test_missing_files_are_named_before_anything_changes(tmp_path, saved_once):
    ckpt, _ = _copy_of(saved_once, tmp_path)
    (ckpt / "optimizer.bin").unlink()
    run, _ = _resume(tmp_path, ckpt, 1)
    assert run.returncode != 0 and "optimizer.bin is missing" in run.stderr


def run_python_code(code: str) -> None:
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
