"""Checkpoint guarantees across real processes (gloo): every checkpoint io saves and loads
with 1, 2 and 4 processes without hanging, a failure on one rank is an error on every rank,
and no load path (DCP, FSDP, DeepSpeed, merge-weights) runs code planted in the files."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from torchbay.storage.files import file_record
from torchbay.storage.publish import MANIFEST
from torchbay.testing.processes import run_python, run_torchrun

pytestmark = pytest.mark.multiprocess


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def worker(script, tmp_path, mode, world, *extra, ckpt="ck", timeout=240):
    out = tmp_path / f"out_{mode}_{world}"
    out.mkdir(exist_ok=True)
    args = ["--mode", mode, "--ckpt", str(tmp_path / ckpt), "--out", str(out), *extra]
    run = run_python(script("checkpoint_worker.py"), args, timeout=timeout) if world == 1 else \
        run_torchrun(script("checkpoint_worker.py"), world, args, timeout=timeout)
    return run, out


def results(out, world):
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(world)]


def refresh_record(ckpt, name):
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][name] = file_record(ckpt / name)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("io", ["safetensors", "dcp"])
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes on 2 cores
def test_every_checkpoint_io_saves_and_loads_in_1_2_and_4_processes(tmp_path, script, io, world):
    run, out = worker(script, tmp_path, "roundtrip", world, "--io", io)
    run.check()
    ranks = results(out, world)
    assert ranks[0]["moved"] > 0 and ranks[0]["after_load"] == 0.0
    if io == "dcp":  # each rank wrote its part of the weights, all of them listed with checksums
        assert "model_0/.metadata" in ranks[0]["files"]
        assert any(f.startswith("model_0/__0_") for f in ranks[0]["files"])


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path, script):
    worker(script, tmp_path, "save", 2)[0].check()
    ckpt = tmp_path / "ck"
    state = torch.load(ckpt / "rng_state_1.pt", weights_only=True)
    state["torch"] = torch.zeros(3, dtype=torch.uint8)  # only rank 1 reads this file
    torch.save(state, ckpt / "rng_state_1.pt")
    refresh_record(ckpt, "rng_state_1.pt")
    run, out = worker(script, tmp_path, "load", 2)
    run.check()
    errors = [r["error"] for r in results(out, 2)]
    assert all("load_state failed on rank 1" in e and "RNG state part 'torch'" in e for e in errors), errors


def test_a_damaged_file_fails_the_load_on_every_rank(tmp_path, script):
    worker(script, tmp_path, "save", 2, "--io", "dcp")[0].check()
    shard = next((tmp_path / "ck" / "model_0").glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF
    shard.write_bytes(bytes(data))
    run, out = worker(script, tmp_path, "load", 2, "--io", "dcp")
    run.check()
    errors = [r["error"] for r in results(out, 2)]
    assert all(f"model_0/{shard.name} does not match its checksum" in e for e in errors), errors


def plant_in_dcp_metadata(metadata_path, marker):
    metadata = pickle.loads(metadata_path.read_bytes())  # test code: written by this test's own run
    metadata.planner_data = Payload(marker)
    metadata_path.write_bytes(pickle.dumps(metadata))


@pytest.mark.slow
def test_fsdp_load_and_merge_weights_refuse_planted_code(tmp_path, script):
    run, _ = worker(script, tmp_path, "save", 2, "--strategy", "fsdp")
    run.check()
    ckpt = tmp_path / "ck"
    plant_in_dcp_metadata(ckpt / "fsdp_model_0" / ".metadata", tmp_path / "pwned")
    refresh_record(ckpt, "fsdp_model_0/.metadata")
    run, out = worker(script, tmp_path, "load", 2, "--strategy", "fsdp")
    run.check()
    for r in results(out, 2):
        assert "needs the class posix.system, which torchbay will not unpickle" in r["error"], r["error"]
    cli = os.path.join(os.path.dirname(sys.executable), "torchbay")
    merged = subprocess.run([cli, "merge-weights", str(ckpt), str(tmp_path / "merged")],
                            capture_output=True, text=True, timeout=120)
    assert merged.returncode != 0 and "needs the class posix.system" in merged.stdout + merged.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "merged").exists()


@pytest.mark.slow
def test_deepspeed_load_refuses_planted_code_in_its_optimizer_states(tmp_path, script):
    run, _ = worker(script, tmp_path, "save", 1, "--strategy", "deepspeed")
    run.check()
    ckpt = tmp_path / "ck"
    (name,) = [n for n in json.loads((ckpt / MANIFEST).read_text())["files"] if n.endswith("optim_states.pt")]
    state = torch.load(ckpt / name, weights_only=False)  # test code: written by this test's own run
    state["evil"] = Payload(tmp_path / "pwned")
    torch.save(state, ckpt / name)
    refresh_record(ckpt, name)
    run, out = worker(script, tmp_path, "load", 1, "--strategy", "deepspeed")
    run.check()
    (r,) = results(out, 1)
    assert "DeepSpeed checkpoint" in r["error"] and "needs the class posix.system" in r["error"], r["error"]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_each_rank_gets_back_its_own_precision_state(tmp_path, script):
    run, out = worker(script, tmp_path, "save", 2, "--rank-precision-state")
    run.check()
    assert {"precision_rank_0.pt", "precision_rank_1.pt"} <= set(results(out, 2)[0]["files"])
    run, out = worker(script, tmp_path, "load", 2, "--rank-precision-state")
    run.check()
    assert [r["rank_precision_state"] for r in results(out, 2)] == [[[0.0] * 3], [[1.0] * 3]]
    run, out = worker(script, tmp_path, "load", 2)  # a precision without per-rank state is given None
    run.check()
    assert [r["rank_precision_state"] for r in results(out, 2)] == [[], []]
