"""``torchbay launch`` with real processes: N ranks really start, failures end the whole job fast,
the rank that failed first is named, nothing is left behind; allocations are read, not guessed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchbay.cli.main import main
from torchbay.testing.processes import free_port

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = TESTS / "scripts"
TORCHBAY = [sys.executable, "-m", "torchbay.cli.main"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHBAY_", "SLURM_", "OMPI_", "PMI_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def processes_mentioning(marker: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``marker`` (read from /proc, no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
        if marker in cmd and state != "Z":
            found.append((int(entry), cmd))
    return found


def launch(args, timeout=180, **env):
    return subprocess.run([*TORCHBAY, "launch", *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(**env), cwd=str(TESTS))


def read_ranks(out_dir: Path, n: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


SCRIPT_ARGS = ["--seed", "99", "--num-processes", "5", "--nproc", "2", "--max", "1", "--monitor", "--project", "x",
               "--", "--num", "3", "-m", "-q"]


@pytest.mark.parametrize("n", [2, 3])
def test_cpu_launch_really_runs_n_ranks(tmp_path, n):
    config = tmp_path / "cfg.yaml"
    config.write_text("gradient_accumulation_steps: 3\nseed: 1\n")
    result = launch([f"--num-processes={n}", "--config-file", str(config), "--seed", "7", "--mixed-precision", "bf16",
                     str(SCRIPTS / "cli_ranks.py"), str(tmp_path), *SCRIPT_ARGS],
                    CLI_TEST_FAKE_ENV="inherited")
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = read_ranks(tmp_path, n)
    assert sorted(r["rank"] for r in ranks) == list(range(n))
    assert {r["world"] for r in ranks} == {n}
    assert len({r["pid"] for r in ranks}) == n, "each rank is its own process"
    assert all(r["sum"] == sum(range(n)) for r in ranks), "a real gloo all_reduce across all n processes"
    # the resolved config reaches each worker as one value; Accelerator() took no arguments
    assert all(r["has_resolved_env"] for r in ranks)
    assert {(r["mixed_precision"], r["gradient_accumulation_steps"], r["seed"]) for r in ranks} == {("bf16", 3, 7)}
    assert {(r["seed_source"], r["steps_source"]) for r in ranks} == {("cli", "file")}
    assert {r["strategy"] for r in ranks} == {"ddp"}
    # arguments after the script are the script's, even when they look like torchbay flags
    # (no abbreviation: --nproc is not --nproc-per-node, for torchbay's parser nor torchrun's; -- is kept)
    assert ranks[0]["argv"] == SCRIPT_ARGS
    # the plan line says where the process count came from
    assert f"{n} processes on 1 machine" in result.stderr and "--num-processes" in result.stderr
    assert not processes_mentioning(str(tmp_path))


def test_lines_of_ranks_printing_at_once_stay_whole(tmp_path):
    """3 ranks print 2000 lines each to stdout and stderr at the same moment, all into one pipe
    read as fast as it fills: no line may be glued to another rank's (under ``python -u`` a line
    and its newline were two writes, and about one line in ten was split)."""
    lines = 2000
    proc = subprocess.Popen([*TORCHBAY, "launch", "-q", "--num-processes", "3", str(SCRIPTS / "cli_lines.py"),
                             str(lines)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), cwd=str(TESTS))
    chunks = []
    try:
        while chunk := proc.stdout.read1(1 << 16):
            chunks.append(chunk)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = b"".join(chunks).decode()
    assert proc.returncode == 0, out[-3000:]
    ours = [line for line in out.splitlines() if "LINE " in line]
    whole = re.compile(r"(RANKLINE [0-2]/3 line \d{5} x*|ERRLINE [0-2]/3 line \d{5})")
    broken = [line for line in ours if not whole.fullmatch(line)]
    assert not broken, f"{len(broken)} lines spliced, e.g. {broken[:3]}"
    assert len(ours) == 2 * 3 * lines
    assert "\n\n" not in out[out.index("LINE "):], "an empty line: a newline written apart"


def _wait_for(paths, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(p.exists() and p.read_text() for p in paths):
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {paths}")


def test_a_process_group_whose_peer_never_comes_is_a_torchbay_error_naming_the_timeout():
    # rank 0 of 2 started by hand, rank 1 never: the set-up gives up after the configured timeout
    code = ("import torchbay\n"
            "try:\n    torchbay.Accelerator()\n"
            "except torchbay.errors.LaunchError as exc:\n    print('LaunchError:', exc)\n")
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TORCHBAY_PROCESS_GROUP_TIMEOUT_S="3")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("LaunchError: rank 0 of 2: the process group did not form within "
                                  "process_group_timeout_s=3"), done.stdout
    assert "TORCHBAY_PROCESS_GROUP_TIMEOUT_S" in done.stdout
    assert time.monotonic() - started < 60


def test_crashing_rank_is_named_first_and_every_rank_stops(tmp_path):
    start = time.time()
    result = launch(["--num-processes", "3", str(SCRIPTS / "cli_fail.py"), str(tmp_path), "raise", "1"])
    ended = time.time()
    failed_at = float((tmp_path / "failed_at").read_text())
    assert result.returncode == 1, result.stderr[-3000:]
    report = result.stderr[result.stderr.index("torchbay launch: rank"):]
    assert report.startswith("torchbay launch: rank 1 failed first"), report
    assert "ValueError: deliberate failure on rank 1" in report
    assert 'cli_fail.py", line' in report, "the first failure's traceback is shown"
    assert "launch/worker.py" not in report.split("then:")[0], "the launcher's own frames are trimmed"
    # the other ranks died of the broken collective afterwards, and are named as consequences
    then = report.split("then:", 1)[1]
    assert "rank 0" in then and "rank 2" in then
    assert ended - failed_at < 15, f"the job took {ended - failed_at:.1f}s to end after the failure"
    assert not processes_mentioning(str(tmp_path)), "no rank may outlive the launcher"
    assert ended - start < 170


def test_killed_rank_ends_the_job(tmp_path):
    proc = subprocess.Popen([*TORCHBAY, "launch", "-q", "--num-processes", "2", str(SCRIPTS / "cli_fail.py"),
                             str(tmp_path), "kill", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=str(TESTS))
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"])
        time.sleep(0.5)
        victim = int((tmp_path / "pid1").read_text())
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "rank 1 failed first (killed by signal SIGKILL" in err, err[-3000:]
    assert f"pid {victim}" in err
    assert ended - killed_at < 15, f"the job took {ended - killed_at:.1f}s to end after the kill"
    assert not processes_mentioning(str(tmp_path))


def test_stopping_the_launcher_stops_every_process(tmp_path):
    proc = subprocess.Popen([*TORCHBAY, "launch", "-q", "--num-processes", "2", str(SCRIPTS / "cli_fail.py"),
                             str(tmp_path), "kill", "9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=str(TESTS))
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"])
        time.sleep(1.0)
        assert len(processes_mentioning(str(tmp_path))) >= 4  # launcher, 2 ranks, rank 0's child
        stopped_at = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by signal SIGTERM" in err
    assert ended - stopped_at < 15
    deadline = time.time() + 5
    while processes_mentioning(str(tmp_path)) and time.time() < deadline:
        time.sleep(0.1)
    assert not processes_mentioning(str(tmp_path))


def test_inside_an_allocation_each_task_becomes_its_rank(tmp_path):
    """``srun -n 2 torchbay launch script`` (simulated): SLURM started the processes; torchbay
    must not start more: each task becomes its rank, with the layout read from the allocation."""
    procs = []
    for rank in range(2):
        env = _env(SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_STEP_ID="0", SLURM_PROCID=str(rank),
                   SLURM_LOCALID=str(rank), SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="node[3-4]")
        procs.append(subprocess.Popen([*TORCHBAY, "launch", str(SCRIPTS / "cli_env.py"), str(tmp_path)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=str(TESTS)))
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    tasks = [json.loads((tmp_path / f"task{r}.json").read_text()) for r in range(2)]
    for rank, task in enumerate(tasks):
        assert (task["RANK"], task["WORLD_SIZE"], task["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert (task["MASTER_ADDR"], task["MASTER_PORT"]) == ("node3", str(10000 + 4242))
        assert task["has_resolved_env"]
        # the worker imports nothing the script does not (no torch for a script without it)
        assert task["modules"] == []
    # each task *is* its rank: the launcher replaced itself by the worker (same pid), no child
    assert [t["pid"] for t in tasks] == [p.pid for p in procs]
    assert "2 processes on 1 machine" in outputs[0][1] and "slurm allocation" in outputs[0][1]


# --- plans (no process started) --------------------------------------------------------------


def dry_run(capsys, *args):
    code = main(["launch", "--dry-run", *args, str(SCRIPTS / "cli_ranks.py")])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_says_where_each_number_came_from(capsys):
    code, out, _ = dry_run(capsys, "--num-processes", "8", "--num-machines", "2", "--main-process-ip", "10.0.0.1",
                           "--machine-rank", "1", "--max-restarts", "3")
    assert code == 0
    assert "num_processes = 8  (command line --num-processes)" in out
    assert "nproc_per_node = 4  (--num-processes 8 / --num-machines 2)" in out
    assert "machine_rank = 1  (command line --machine-rank)" in out
    assert "--nnodes 2 --nproc-per-node 4 --max-restarts 3" in out
    assert "--node-rank 1 --master-addr 10.0.0.1 --master-port 29500" in out


def test_plan_from_file_and_env(capsys, tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("launch:\n  nproc_per_node: 3\n")
    monkeypatch.setenv("TORCHBAY_LAUNCH__NUM_MACHINES", "2")
    monkeypatch.setenv("TORCHBAY_LAUNCH__MAIN_PROCESS_IP", "node0")
    code, out, _ = dry_run(capsys, "--config-file", str(cfg))
    assert code == 0
    assert "nproc_per_node = 3  (config file)" in out
    assert "num_machines = 2  (environment TORCHBAY_LAUNCH__NUM_MACHINES)" in out
    assert "num_processes = 6  (--nproc-per-node 3 x --num-machines 2)" in out


def test_rendezvous_backend(capsys):
    code, out, _ = dry_run(capsys, "--nproc-per-node", "2", "--num-machines", "4", "--rdzv-backend", "c10d",
                           "--main-process-ip", "head", "--main-process-port", "29400")
    assert code == 0
    assert "--rdzv-backend c10d --rdzv-endpoint head:29400" in out


def test_single_machine_picks_a_free_port_like_torchrun(capsys):
    code, out, _ = dry_run(capsys, "--num-processes", "2")
    assert code == 0 and "--master-port" not in out and "--nnodes 1 --nproc-per-node 2" in out


def test_slurm_one_launcher_per_machine(capsys, monkeypatch):
    for k, v in dict(SLURM_JOB_ID="1234", SLURM_JOB_NAME="train", SLURM_STEP_ID="0", SLURM_PROCID="1",
                     SLURM_NODEID="1", SLURM_LOCALID="0", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="2",
                     SLURM_JOB_NODELIST="gpu[07-08]").items():
        monkeypatch.setenv(k, v)
    code, out, _ = dry_run(capsys, "--nproc-per-node", "4")
    assert code == 0, out
    assert "num_machines = 2  (the slurm allocation)" in out
    assert "machine_rank = 1  (the slurm allocation)" in out
    assert "main_process_ip = gpu07  (the slurm allocation)" in out
    assert "main_process_port = 11234  (the slurm allocation)" in out
    assert "num_processes = 8" in out


def test_mpi_allocation_runs_in_place(capsys, monkeypatch):
    for k, v in dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
                     OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="head", MASTER_PORT="2222").items():
        monkeypatch.setenv(k, v)
    code, out, _ = dry_run(capsys)
    assert code == 0
    assert "mode = direct (processes started by openmpi)" in out
    assert "num_processes = 4  (the openmpi allocation)" in out and "machine_rank = 1" in out
    code, _, err = dry_run(capsys, "--num-processes", "8", "--nproc-per-node", "8")
    assert code == 2 and "runs 2 tasks per machine" in err


# --- hung and vanished ranks ------------------------------------------------------------------


def _report(stderr: str) -> str:
    """The launcher's summary; nothing but one-line notes may come before it."""
    start = stderr.index("torchbay launch: rank")
    assert "Traceback" not in stderr[:start], stderr[:start]
    return stderr[start:]


def test_rank_that_never_reaches_the_collective_is_named_with_every_ranks_stack(tmp_path):
    start = time.time()
    result = launch(["-q", "--num-processes", "2", str(SCRIPTS / "cli_hang.py"), str(tmp_path), "sleep", "1", "4"],
                    timeout=120)
    took = time.time() - start
    assert result.returncode == 1, result.stderr[-3000:]
    report = _report(result.stderr)
    head = report.splitlines()[0]
    assert head.startswith("torchbay launch: rank 1 never reached the collective the other ranks waited in: it was "
                           "at cli_hang.py:"), report
    assert "in load_my_shard" in head
    where = report[report.index("where each rank was:"):]
    assert "rank 0: in torch.distributed.barrier called at cli_hang.py:" in where, report
    assert "rank 1: at cli_hang.py:" in where and "not in a collective (stopped by the launcher)" in where
    folded = report[report.index("secondary tracebacks"):]
    assert "  | Traceback (most recent call last):" in folded  # rank 0's timeout, under the summary
    assert (tmp_path / "timeout0").read_text() == "4.0", "InitProcessGroupKwargs(timeout=...) reaches the group"
    assert took < 60, f"{took:.0f}s: the 4 s timeout was not applied"
    assert not processes_mentioning(str(tmp_path))


def test_rank_that_leaves_early_is_named_first(tmp_path):
    result = launch(["-q", "--num-processes", "2", "--process-group-timeout-s", "20", str(SCRIPTS / "cli_hang.py"),
                     str(tmp_path), "exit0", "1"], timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    report = _report(result.stderr)
    assert report.startswith("torchbay launch: rank 1 left first: it exited with code 0 at "), report
    assert "rank 1: exited with code 0" in report and "rank 0: in torch.distributed.barrier" in report
    assert (tmp_path / "timeout0").read_text() == "20.0", "the config's process_group_timeout_s reaches the group"
    assert not processes_mentioning(str(tmp_path))


def test_rank_that_leaves_before_the_process_group_forms_is_named_not_the_rank_that_waited(tmp_path):
    # rank 0 times out waiting for the group (a torchbay LaunchError of its own): still a consequence
    result = launch(["-q", "--num-processes", "2", "--process-group-timeout-s", "5", str(SCRIPTS / "cli_hang.py"),
                     str(tmp_path), "exit0-before-group", "1"], timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    report = _report(result.stderr)
    assert report.startswith("torchbay launch: rank 1 left first: it exited with code 0 at "), report
    assert "then: rank 0 (exit code 1: LaunchError: rank 0 of 2: the process group did not form" in report
    where = report[report.index("where each rank was:"):]
    assert "rank 0: in torch.distributed.init_process_group called at cli_hang.py:" in where, report
    assert "rank 1: exited with code 0" in where
    assert not processes_mentioning(str(tmp_path))


def test_ranks_in_different_collectives_are_named_with_their_call_sites(tmp_path):
    result = launch(["-q", "--num-processes", "2", str(SCRIPTS / "cli_hang.py"), str(tmp_path), "mismatch", "1", "4"],
                    timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    report = result.stderr[result.stderr.index("torchbay launch: "):]
    head = report.splitlines()[0]
    assert re.match(r"torchbay launch: the ranks are in different collectives: "
                    r"rank 0 in torch\.distributed\.all_reduce "
                    r"called at cli_hang\.py:\d+ in sum_losses; rank 1 in torch\.distributed\.all_gather called at "
                    r"cli_hang\.py:\d+ in collect_metrics; every rank must enter the same collectives", head), report
    assert "Traceback" not in result.stderr[:result.stderr.index("torchbay launch: ")]
    # each rank times out in its own collective; under load the launcher may stop the second before it exits itself
    ended = re.search(r"how each rank ended: (.*)", report)
    assert ended and re.search(r"rank 0 \((exit code 1|stopped)", ended.group(1)) and \
        re.search(r"rank 1 \((exit code 1|stopped)", ended.group(1)), report
    assert not processes_mentioning(str(tmp_path))


def test_sigkill_to_the_launcher_leaves_no_process(tmp_path):
    proc = subprocess.Popen([*TORCHBAY, "launch", "-q", "--num-processes", "2", str(SCRIPTS / "cli_fail.py"),
                             str(tmp_path), "kill", "9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=str(TESTS))
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"])
        time.sleep(1.0)
        assert len(processes_mentioning(str(tmp_path))) >= 4  # launcher, 2 ranks, rank 0's child
        proc.kill()  # SIGKILL: the launcher cannot clean up
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.time() + 10
    while processes_mentioning(str(tmp_path)) and time.time() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(tmp_path)) == []


def test_ctrl_c_on_a_hung_job_says_where_each_rank_was(tmp_path):
    proc = subprocess.Popen([*TORCHBAY, "launch", "-q", "--num-processes", "2", str(SCRIPTS / "cli_hang.py"),
                             str(tmp_path), "sleep", "1", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=str(TESTS))
    try:
        _wait_for([tmp_path / "timeout0", tmp_path / "timeout1"])
        time.sleep(1.5)  # rank 0 waits in the barrier, rank 1 in its own work
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    report = err[err.index("torchbay launch: stopped by signal SIGINT"):]
    assert "where each rank was:" in report
    assert "rank 0: in torch.distributed.barrier called at cli_hang.py:" in report, report
    assert "rank 1: at cli_hang.py:" in report and "in load_my_shard, not in a collective" in report
    assert not processes_mentioning(str(tmp_path))


def test_ranks_waiting_inside_backward_are_not_blamed(tmp_path):
    """Three ranks: 0 and 2 wait in DDP's gradient all-reduce (run by torch's C++ inside
    backward, no torch.distributed frame); rank 1 never gets there, and only rank 1 is blamed."""
    result = launch(["-q", "--num-processes", "3", str(SCRIPTS / "cli_hang.py"), str(tmp_path), "backward", "1", "4"],
                    timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    report = _report(result.stderr)
    assert report.startswith("torchbay launch: rank 1 never reached the collective"), report
    where = report[report.index("where each rank was:"):]
    for rank in (0, 2):
        assert f"rank {rank}: in backward (DDP's gradient all-reduce runs in it)" in where, report
    assert "rank 1: at cli_hang.py:" in where and "in load_my_shard, not in a collective" in where
    assert not processes_mentioning(str(tmp_path))
