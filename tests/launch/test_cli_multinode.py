"""Multi-machine launches and elastic restarts, run for real on this one machine: two
``torchbay launch`` agents that each start 2 processes train to the same weights as one agent
with 4; a job whose worker is SIGKILLed mid-run restarts (--max-restarts 1), resumes from the
newest automatic checkpoint and ends with the weights of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchbay.testing.processes import free_port

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = str(TESTS / "scripts" / "cli_elastic.py")
STEPS = "4"
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # two launchers of 2 processes each


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHBAY_", "SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def start(*args):
    return subprocess.Popen([sys.executable, "-m", "torchbay.cli.main", "launch", "-q", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(TESTS))


def finish(*procs, timeout=180):
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-4000:]
    return outs


def result(out_dir: Path) -> dict:
    return json.loads((out_dir / "result.json").read_text())


def assert_same_weights(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), atol=atol, rtol=0, msg=key)


def test_two_machines_train_like_one(tmp_path):
    finish(start("--num-processes", "4", SCRIPT, str(tmp_path / "one"), STEPS))
    reference = result(tmp_path / "one")
    assert reference["world"] == 4

    port = free_port()
    machines = [start("--num-machines", "2", "--machine-rank", str(m), "--nproc-per-node", "2",
                      "--main-process-ip", "127.0.0.1", "--main-process-port", str(port),
                      SCRIPT, str(tmp_path / "static"), STEPS) for m in (0, 1)]
    finish(*machines)
    static = result(tmp_path / "static")
    assert static["world"] == 4
    assert_same_weights(reference["weights"], static["weights"])

    endpoint = f"127.0.0.1:{free_port()}"
    machines = [start("--num-machines", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", endpoint, "--rdzv-id", "job7",
                      SCRIPT, str(tmp_path / "rdzv"), STEPS) for m in (0, 1)]
    finish(*machines)
    rdzv = result(tmp_path / "rdzv")
    assert rdzv["world"] == 4
    assert_same_weights(reference["weights"], rdzv["weights"])


def test_killed_worker_restarts_and_resumes_from_the_newest_checkpoint(tmp_path):
    finish(start("--num-processes", "2", SCRIPT, str(tmp_path / "plain"), STEPS))
    plain = result(tmp_path / "plain")

    job = start("--num-processes", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
                SCRIPT, str(tmp_path / "killed"), STEPS, "--stall-rank", "1", "--stall-after", "2")
    try:
        stalled = tmp_path / "killed" / "stalled"
        deadline = time.time() + 120
        while not (stalled.exists() and stalled.read_text()) and time.time() < deadline and job.poll() is None:
            time.sleep(0.1)
        assert stalled.exists(), job.communicate(timeout=30)[1][-3000:]
        os.kill(int(stalled.read_text()), signal.SIGKILL)
        (_, err), = finish(job)
    finally:
        if job.poll() is None:
            job.kill()
    killed = result(tmp_path / "killed")
    assert killed["attempt"] == 1, "the job was restarted once"
    assert killed["resumed"].endswith("checkpoint_1"), killed["resumed"]  # after step 2: checkpoints 0 and 1
    assert_same_weights(plain["weights"], killed["weights"], atol=0)
