"""torchbay under a real SLURM: Debian's slurm-wlm (slurmctld, slurmd, munge) on this one machine.

tests/slurm/start_cluster.sh installs the packages when missing (``.ci/run`` does it before
``make test``) and starts the daemons with everything under a temporary directory; the tests
skip, naming what is missing, where the packages cannot be installed or the daemons do not start.
Each job is a 2-task torchbay job (tests/slurm/train.py: a tiny model, a few DDP steps over gloo):
rank, world size and the rendezvous address must come from SLURM, and both ranks must end with
the same weights. The cluster is stopped at the end, and no process of it may be left. The cluster
cases are marked slow: ``make test-slow`` runs them, ``make test`` leaves them out.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchbay.builtin.cluster import SlurmEnvironment, expand_first_host, tasks_per_node

TESTS = Path(__file__).resolve().parents[1]
SLURM_DIR = TESTS / "slurm"
TRAIN = SLURM_DIR / "train.py"
JOB_TIMEOUT = 150


def _processes_mentioning(text: str) -> list[str]:
    """Processes (not this one) whose command line, working directory or open files name ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(proc / "cwd")]
            fd_dir = proc / "fd"
            links += [os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)]
        except OSError:
            continue
        if text in cmdline or any(link.startswith(text) for link in links):
            found.append(f"{proc.name}: {cmdline.strip()[:200]}")
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster: yields ``(directory, environment for srun/sbatch)``."""
    if not sys.platform.startswith("linux") or shutil.which("bash") is None:
        pytest.skip("the SLURM test needs Linux with bash")
    directory = tmp_path_factory.mktemp("slurm")
    started = time.monotonic()
    try:
        proc = subprocess.run(["bash", str(SLURM_DIR / "start_cluster.sh"), str(directory)], capture_output=True,
                              text=True, timeout=240)
        if proc.returncode in (3, 4):
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
            pytest.skip(f"no SLURM cluster here: {reason}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        print(f"SLURM cluster up in {time.monotonic() - started:.1f} s: {proc.stdout.strip()}")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "TORCHBAY_", "TORCHELASTIC_", "MASTER_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")}
        env["SLURM_CONF"] = str(directory / "slurm.conf")
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        yield directory, env
    finally:
        subprocess.run(["bash", str(SLURM_DIR / "stop_cluster.sh"), str(directory)], timeout=60)
        deadline = time.monotonic() + 10
        while _processes_mentioning(str(directory)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _processes_mentioning(str(directory))
        pids = (directory / "pids").read_text().split() if (directory / "pids").exists() else []
        alive = [f"{name} {pid}" for name, pid in zip(pids[::2], pids[1::2]) if Path(f"/proc/{pid}").exists()
                 and "Z" not in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() or ["Z"])[0]]
        assert not left and not alive, f"processes of the SLURM test left running: {left + alive}"


def _run(cmd: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    print(f"{' '.join(cmd[:4])}... exit {proc.returncode} in {time.monotonic() - started:.1f} s")
    return proc


def _results(directory: Path, tag: str) -> list[dict]:
    return [json.loads((directory / f"{tag}.rank{r}.json").read_text()) for r in range(2)]


def _job_id(results: list[dict]) -> str:
    return results[0]["slurm"]["SLURM_JOB_ID"]


def _check_trained_as_one_job(results: list[dict], *, cluster: str):
    """Two ranks of one job, laid out by SLURM, that trained together."""
    host = socket.gethostname().split(".")[0]
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)], results
    for r in results:
        assert r["cluster"] == cluster and r["backend"] == "gloo", r
        assert r["MASTER_ADDR"] == expand_first_host(r["slurm"]["SLURM_JOB_NODELIST"]) == host
        assert r["MASTER_PORT"] == str(10000 + int(_job_id(results)[-4:]))
    assert {_job_id([r]) for r in results} == {_job_id(results)}
    # DDP: the same reduced losses on both ranks, falling, and the same weights at the end
    assert results[0]["losses"] == results[1]["losses"] and results[0]["losses"][-1] < results[0]["losses"][0] / 2
    assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_srun_runs_the_script_directly(slurm):
    """``srun -n 2 python train.py``: each task is a rank, read from SLURM by the Accelerator."""
    directory, env = slurm
    proc = _run(["srun", "-n", "2", sys.executable, str(TRAIN), "--out", str(directory), "--tag", "srun"],
                env, directory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(directory, "srun")
    _check_trained_as_one_job(results, cluster="slurm")
    assert [r["slurm"]["SLURM_PROCID"] for r in results] == ["0", "1"]
    assert [r["local_rank"] for r in results] == [0, 1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_srun_torchbay_launch_under_salloc(slurm):
    """``salloc -n 2`` then ``srun torchbay launch train.py``: each task becomes its rank in place. The
    job is named ``interactive`` (salloc's name), which torchbay once took for an interactive shell and
    ran each task as a job of its own, rank 0 of 1."""
    directory, env = slurm
    proc = _run(["salloc", "-n", "2", "srun", "torchbay", "launch", str(TRAIN), "--out", str(directory),
                 "--tag", "salloc"], env, directory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(directory, "salloc")
    # the launcher read the layout from SLURM and handed it on as torchrun's variables (RANK...)
    _check_trained_as_one_job(results, cluster="torchrun")
    assert {r["slurm"]["SLURM_JOB_NAME"] for r in results} == {"interactive"}
    assert not any(r["torchelastic"] for r in results)  # no torchrun agent: the task is the rank
    assert "2 processes on 1 machine" in proc.stderr and "slurm allocation" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sbatch_one_task_per_process_and_one_launcher_per_machine(slurm, monkeypatch):
    """A batch script (``sbatch -n 2``), as docs/fault-tolerance.md shows it: ``srun python train.py``
    (one task per rank), then ``srun --ntasks-per-node=1 torchbay launch --nproc-per-node 2`` (one
    launcher for the machine, torchrun starts the ranks). The batch script itself is not a task:
    SLURM gives it ``SLURM_PROCID=0`` and ``SLURM_NTASKS=2``, and a script run there must not wait
    for a rank 1 that never comes."""
    directory, env = slurm
    out = directory / "sbatch.out"
    python = sys.executable
    batch = directory / "job.sh"
    batch.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --job-name=torchbay-test
#SBATCH --output={out}
set -e
env | grep ^SLURM_ > {directory}/batch_step.env
echo "STEP 1 $(date +%s.%N)"
srun {python} {TRAIN} --out {directory} --tag sbatch
echo "STEP 2 $(date +%s.%N)"
srun --ntasks=1 --ntasks-per-node=1 torchbay launch --nproc-per-node 2 {TRAIN} --out {directory} --tag launcher
echo "BATCH DONE $(date +%s.%N)"
""")
    proc = _run(["sbatch", "--wait", str(batch)], env, directory)
    output = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + output
    assert "BATCH DONE" in output, output
    print("".join(line + "\n" for line in output.splitlines() if line.startswith(("STEP", "BATCH DONE"))), end="")
    # the batch script's own variables, as SLURM set them: not a rank (before: rank 0 of 2)
    batch_env = dict(line.split("=", 1) for line in (directory / "batch_step.env").read_text().splitlines())
    assert (batch_env["SLURM_PROCID"], batch_env["SLURM_NTASKS"]) == ("0", "2")
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in batch_env.items():
        monkeypatch.setenv(key, value)
    assert not SlurmEnvironment.detect()
    results = _results(directory, "sbatch")
    _check_trained_as_one_job(results, cluster="slurm")
    assert {r["slurm"]["SLURM_JOB_NAME"] for r in results} == {"torchbay-test"}
    assert _job_id(results) in proc.stdout  # "Submitted batch job N"
    # one launcher: torchrun's agent started both ranks; the address and port still came from SLURM
    launched = _results(directory, "launcher")
    assert [(r["rank"], r["world"], r["cluster"]) for r in launched] == [(0, 2, "torchrun"), (1, 2, "torchrun")]
    assert all(r["torchelastic"] for r in launched)
    assert {r["slurm"]["SLURM_STEP_NUM_TASKS"] for r in launched} == {"1"}
    assert launched[0]["losses"] == launched[1]["losses"] == results[0]["losses"]
    assert "num_processes from --nproc-per-node 2 x --num-machines 1" in output, output


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_failing_task_is_named(slurm):
    """Rank 1 raises at step 2; rank 0 learns it inside a collective. The job's output names task 1
    (srun's line and the rank's own traceback), and the job fails."""
    directory, env = slurm
    proc = _run(["srun", "-n", "2", sys.executable, str(TRAIN), "--out", str(directory), "--tag", "fail",
                 "--fail-rank", "1"], env, directory)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert re.search(r"srun: error: \S+: task 1: Exited with exit code 1", output), output
    assert re.search(r"\[rank1\]: RuntimeError: deliberate failure on rank 1 at step 2", output), output
    # rank 0's error is the consequence, and says so in torch's words
    assert "[rank0]:" in output and "Connection closed by peer" in output, output
    assert not (directory / "fail.rank0.json").exists()


@pytest.mark.parametrize("value, counts", [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("8(x2)", [8, 8]), ("", []),
                                           ("2,bad", [])])
def test_tasks_per_node_reads_slurms_compressed_form(value, counts):
    assert tasks_per_node(value) == counts


def test_a_step_on_part_of_a_multi_node_allocation(monkeypatch):
    """What one machine cannot show: ``srun -N 2 -n 3`` on nodes gpu[07-09] (the step's counts and
    nodes win over the allocation's); the batch script and salloc's shell are not ranks."""
    for key in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_"))]:
        monkeypatch.delenv(key)
    for key, value in dict(SLURM_JOB_ID="7", SLURM_STEP_ID="1", SLURM_PROCID="2", SLURM_NODEID="1",
                           SLURM_LOCALID="0", SLURM_NTASKS="3", SLURM_STEP_NUM_TASKS="3",
                           SLURM_TASKS_PER_NODE="2,1", SLURM_STEP_TASKS_PER_NODE="2,1",
                           SLURM_JOB_NODELIST="gpu[07-09]", SLURM_STEP_NODELIST="gpu[08-09]").items():
        monkeypatch.setenv(key, value)
    env = SlurmEnvironment()
    assert SlurmEnvironment.detect()
    assert (env.rank(), env.world_size(), env.local_rank(), env.local_world_size()) == (2, 3, 0, 1)
    assert (env.main_address(), env.main_port()) == ("gpu08", 10007)
    monkeypatch.setenv("SLURM_STEP_ID", str(0xFFFFFFFB))  # the batch step's reserved id
    assert not SlurmEnvironment.detect()
    for key in ("SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(key, raising=False)
    assert not SlurmEnvironment.detect()  # sbatch's script: SLURM_PROCID=0 but no step
