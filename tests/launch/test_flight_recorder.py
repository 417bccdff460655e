"""The collective flight recorder's dumps in the failure report (core/torchbay/launch/flight_recorder.py): dumps
recorded here by a real two-rank gloo job (tests/launch/record_collectives.py, torch's own recorder), read without
unpickling any class, and the rank, collective and sequence number where the ranks diverged named."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch

from torchbay.launch.flight_recorder import DUMP_PREFIX, describe_dumps, load_dump, read_dumps

RECORD = os.path.join(os.path.dirname(__file__), "record_collectives.py")
pytestmark = pytest.mark.skipif(not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"),
                                reason="this torch has no flight recorder for gloo")


def record(directory, scenario: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, RECORD, str(rank), port, str(directory), scenario], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    for proc in ranks:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode(errors="replace")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One recorded job per scenario (both ranks' dumps in a folder of its own)."""
    folders = {}
    for scenario in ("mismatch", "missing", "same"):
        folders[scenario] = tmp_path_factory.mktemp(scenario)
        record(folders[scenario], scenario)
    return folders


def test_ranks_in_different_collectives_are_named_with_the_sequence_number(recorded):
    lines = describe_dumps(str(recorded["mismatch"]))
    assert lines[0] == "collective flight recorder (dumps of ranks 0, 1):"
    assert "diverged at collective #3: rank 0 in gloo:all_reduce [[4]]; rank 1 in gloo:broadcast [[8]]" in lines[1]


def test_a_rank_that_never_entered_the_collective_is_named(recorded):
    lines = describe_dumps(str(recorded["missing"]))
    assert ("rank 1 never entered collective #3 (gloo:all_reduce [[4]]) that rank 0 waited in; rank 1 last entered "
            "#2 (gloo:all_reduce [[4]]") in lines[1]


def test_ranks_that_agree_show_the_last_collective(recorded):
    lines = describe_dumps(str(recorded["same"]))
    assert "every rank entered collective #2 (gloo:all_reduce [[4]]), the last recorded" in lines[1]


def test_a_dump_that_names_a_class_is_not_unpickled(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    (tmp_path / f"{DUMP_PREFIX}0").write_bytes(pickle.dumps({"entries": [Payload()]}))
    (tmp_path / f"{DUMP_PREFIX}1").write_bytes(b"{\"version\": \"2.10\", \"entries\": []}")  # the json form
    dumps, problems = read_dumps(str(tmp_path))
    assert list(dumps) == [1] and len(problems) == 1 and "reads no classes" in problems[0]
    with pytest.raises(ValueError, match="not a flight recorder dump"):
        load_dump(b"garbage")
    assert describe_dumps(str(tmp_path / "none")) == []


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 1, reason="CUDA missing: the "
                    "nccl path (a real NCCL job's dump) runs on a GPU machine")
def test_nccl_dump_of_this_gpu_reads(tmp_path):
    import torch.distributed as dist

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        dump = torch._C._distributed_c10d._dump_nccl_trace()
    finally:
        dist.destroy_process_group()
    (tmp_path / f"{DUMP_PREFIX}0").write_bytes(dump)
    lines = describe_dumps(str(tmp_path))
    assert "every rank entered collective #2 (nccl:all_reduce [[4]])" in lines[1], lines


def test_the_launch_failure_report_names_where_the_ranks_diverged(recorded):
    """Both ranks timed out in a collective (consequences): the report's flight recorder lines follow."""
    import shutil
    import signal as sig
    from types import SimpleNamespace

    from torchbay.launch.failures import describe_failures

    def timed_out(rank):
        extra = {"py_callstack": "Traceback (most recent call last):\nDistBackendError: Watchdog caught collective "
                                 "operation timeout", "timestamp": "100", "torchbay_time_ns": str(5000 + rank),
                 "torchbay_consequence": "1", "torchbay_exit_code": "1"}
        return SimpleNamespace(local_rank=rank, pid=1000 + rank, exitcode=1, timestamp=100,
                               error_file_data={"message": {"message": "DistBackendError: timeout",
                                                            "extraInfo": extra}},
                               signal_name=lambda: sig.Signals(15).name)

    run_dir = recorded["mismatch"].parent / "run_dir"
    shutil.copytree(recorded["mismatch"], run_dir)
    report, _ = describe_failures({0: timed_out(0), 1: timed_out(1)}, SimpleNamespace(num_machines=1, machine_rank=0),
                                  str(run_dir))
    lines = report.splitlines()
    at = lines.index("collective flight recorder (dumps of ranks 0, 1):")
    assert "diverged at collective #3: rank 0 in gloo:all_reduce" in lines[at + 1]
    assert lines[-1].startswith("every process of the job was stopped")
