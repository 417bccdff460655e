"""Sharded (DCP) checkpoints of split experts (issue 39): save_state at ep 2 x dp_shard 2 writes every expert weight
whole under its original name (torchbay_fsdp.experts.checkpoint), so DCP reshards it like any other tensor.

Five launches of plugins/fsdp/tests/scripts/experts_resume.py (the torchtitan-style tiny MoE with 6 experts: at
ep 2 x dp_shard 2 each ep rank's 3 experts are FSDP2-sharded 2 + 1, an uneven split; no transformers needed):
1 process at ep 1 (saves ``ckpt_ep1``), 4 processes at ep 2 x dp_shard 2 (saves ``ckpt_ep`` and, with
``blocking=False``, ``ckpt_async``; merges ``ckpt_ep``; resumes from both at the same layout and from ``ckpt_ep1``),
4 processes at dp_replicate 2 x dp_shard 2 x ep 2 (HSDP: trained against the 1-process run, saves and merges
``ckpt_hsdp``, resumes from it and from ``ckpt_ep1``), then ``ckpt_ep`` loaded on 1 process at ep 1 (and
``ckpt_hsdp`` there) and on 2 at ep 2. Observed: same-layout resumes bit-exact; across layouts, loaded weights
exact, losses equal to 5e-7 and final weights to 1.2e-7; HSDP against one process: first gradients to 3e-8,
losses to 3e-7, weights after 5 AdamW steps to 5e-6 (with FSDP2's force-sum left on over one shard, which
divides twice, the gradients were 1.6e-2 off).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from torchbay.testing.processes import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "experts_resume.py")
ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("experts_ckpt")
    for phase, procs in (("first", 1), ("ep", 4), ("hsdp", 4), ("load", 1), ("load", 2)):
        run_torchrun(SCRIPT, procs, ["--out", str(out), "--phase", phase], timeout=400).check()
    names = {"first": "first.json", "ep": "ep.json", "hsdp": "hsdp.json", "load_1": "load_1.json",
             "load_2": "load_2.json"}
    return {key: json.loads((out / name).read_text()) for key, name in names.items()}


@pytest.mark.multiprocess
def test_a_resume_at_the_same_layout_is_exact_blocking_or_not(runs):
    ep = runs["ep"]
    for name in ("same_layout", "same_layout_async"):
        got = ep[name]
        assert got["keys_match"] and got["loaded_max_diff"] == 0.0, (name, got)
        assert got["losses"] == ep["losses"], name
        assert got["final_max_diff"] == 0.0, name
        assert {tuple(shape) for shape in got["expert_shapes"].values()} == {(6, 32, 16), (6, 16, 32)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["load_1", "load_2"])
def test_a_checkpoint_saved_at_ep_2_x_dp_2_loads_at_ep_1_and_at_ep_2_on_two_processes(runs, where):
    got, ep = runs[where], runs["ep"]
    assert got["keys_match"] and got["loaded_max_diff"] == 0.0, got
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ep["losses"]), atol=ATOL, rtol=0)
    assert got["final_max_diff"] <= ATOL


@pytest.mark.multiprocess
def test_a_checkpoint_saved_at_ep_1_on_one_process_loads_at_ep_2_x_dp_2(runs):
    got = runs["ep"]["from_ep1"]
    assert got["keys_match"] and got["loaded_max_diff"] == 0.0, got
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(runs["first"]["losses"]), atol=ATOL, rtol=0)
    assert got["final_max_diff"] <= ATOL


@pytest.mark.multiprocess
def test_merge_weights_of_an_ep_checkpoint_writes_the_full_model_in_its_original_names(runs):
    merged = runs["ep"]["merged"]  # against accelerator.get_state_dict at the save
    assert merged["keys_match"] and merged["max_diff"] == 0.0
    assert merged["expert_shapes"] == [[6, 16, 32], [6, 32, 16]]


# --- ep with HSDP: dp_replicate 2 x dp_shard 2 x ep 2 ---------------------------------------------------------


@pytest.mark.multiprocess
def test_ep_with_dp_replicate_trains_as_one_process_does(runs):
    """Each replica's ep group (consecutive dp_shard ranks) holds 3 experts per rank, HSDP'd over
    (dp_replicate, dp_shard_mod_ep); gradients (every expert gathered) and losses of all 5 steps, and the weights
    at the save and after it, equal the 1-process ep 1 run's."""
    hsdp, first = runs["hsdp"], runs["first"]
    for layout in hsdp["layouts"]:
        assert {tuple(v["local"][:1]) for v in layout.values()} == {(3,)}, layout
        assert {tuple(v["mesh"]) for v in layout.values()} == {("dp_replicate", "dp_shard_mod_ep")}, layout
    assert hsdp["grad_max_diff"] <= 1e-6  # AdamW would hide a gradient off by a constant factor
    # the 8-process branch (dp_shard / ep above 1: force-sum) on a 3-D weight over dp_replicate 2 x dp_shard 2
    assert hsdp["sum_then_divide"] == 0.0
    torch.testing.assert_close(torch.tensor(hsdp["all_losses"]), torch.tensor(first["all_losses"]), atol=ATOL,
                               rtol=0)
    assert hsdp["at_save_max_diff"] <= ATOL and hsdp["final_max_diff"] <= ATOL


@pytest.mark.multiprocess
def test_a_checkpoint_saved_with_dp_replicate_resumes_and_reshards_both_ways(runs):
    hsdp = runs["hsdp"]
    same = hsdp["same_layout"]
    assert same["keys_match"] and same["loaded_max_diff"] == 0.0 and same["final_max_diff"] == 0.0, same
    assert hsdp["merged"]["keys_match"] and hsdp["merged"]["max_diff"] == 0.0
    for got, reference in ((runs["load_1"]["from_hsdp"], hsdp), (hsdp["from_ep1"], runs["first"])):
        assert got["keys_match"] and got["loaded_max_diff"] == 0.0, got
        after = reference["all_losses"][-len(got["losses"]):]  # the steps after the save
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(after), atol=ATOL, rtol=0)
        assert got["final_max_diff"] <= ATOL
