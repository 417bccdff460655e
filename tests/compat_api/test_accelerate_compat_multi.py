"""Accelerate-compat behaviours with 2 real gloo processes (and the launchers that start them)."""

import json

import pytest

from torchbay.testing.processes import run_torchrun

pytestmark = pytest.mark.multiprocess


def test_two_process_behaviours(tmp_path, script):
    run_torchrun(script("compat_multi.py"), 2, [str(tmp_path)]).check()
    ranks = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks) == 2
    r0, r1 = ranks
    assert r0["gather"] == [1.0, 2.0, 2.0, 3.0]
    assert r0["reduce_sum"] == r1["reduce_sum"] == [3.0, 5.0]
    assert r0["reduce_mean_default"] == [1.5, 2.5]  # Accelerate's reduce defaults to mean
    assert r0["broadcast"] == r1["broadcast"] == [2.0, 3.0]
    assert r0["pad"] == [1.0, -1.0] and r1["pad"] == [1.0, 1.0]
    lines = (tmp_path / "ordered.log").read_text().splitlines()
    assert lines == [f"call {c} rank {r}" for c in range(3) for r in range(2)]
    for r in ranks:
        assert r["synced_first_micro_batch_sync_each_batch=False"] is False
        assert r["synced_first_micro_batch_sync_each_batch=True"] is True
        assert r["trigger_sync_in_backward"] is True
        assert r["join_warns_for_non_ddp"] is True
        assert r["hook_fp16"] and r["hook_power_sgd"]
    assert [r0["join_batches"], r1["join_batches"]] == [2, 1]


def _report_world():
    from torchbay import PartialState

    state = PartialState()
    assert state.num_processes == 2 and state.distributed_type == "MULTI_CPU"


def test_debug_launcher_starts_two_cpu_processes():
    from torchbay import debug_launcher

    debug_launcher(_report_world, num_processes=2)


def test_notebook_launcher_rendezvous_elsewhere_when_the_default_port_is_taken(capfd):
    import socket

    from torchbay import notebook_launcher
    from torchbay.launch.notebook import DEFAULT_PORT

    holder = socket.socket()
    try:
        try:
            holder.bind(("", int(DEFAULT_PORT)))
            holder.listen()
        except OSError:
            pass  # someone else holds it already: the case under test all the same
        notebook_launcher(_report_world, num_processes=2, device="cpu")
    finally:
        holder.close()
    assert f"port {DEFAULT_PORT} is in use on this machine; rendezvous on port" in capfd.readouterr().err
