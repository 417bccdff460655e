"""save_state(blocking=False) with FSDP1, and an asynchronous save that cannot start on one rank, with 2 real
gloo processes on the CPU (scripts/async_strategies_worker.py); real FSDP, real files, no mocked collectives.
DeepSpeed's (synchronous, with its warning) is in plugins/deepspeed/tests/test_deepspeed.py."""

import json

import pytest

from torchbay.storage import publish as ckdir
from torchbay.testing.processes import run_torchrun


def _run(script, tmp_path, *args: str) -> list[dict]:
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    # the timeout is the test's: a rank left waiting in a collective fails it instead of hanging it
    run_torchrun(script("async_strategies_worker.py"), 2, [*args, "--ckpt", str(ckpt), "--out", str(out)],
                 timeout=240).check()
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
def test_fsdp1_saves_in_the_background_the_state_at_the_call(tmp_path, script):
    pytest.importorskip("torchbay_fsdp")
    for r in _run(script, tmp_path, "--mode", "state", "--strategy", "fsdp1"):
        assert r["world"] == 2 and not r["done_at_return"] and r["changed"] and r["published"]
        assert r["equal_at_call"]  # loaded back: bit for bit the full state taken at the call
        assert r["warnings"] == []  # no synchronous fallback
    manifest = json.loads((tmp_path / "ck" / "a" / ckdir.MANIFEST).read_text())
    files = set(manifest["files"])
    assert {"fsdp_model_0/.metadata", "fsdp_optimizer_0/.metadata", "rng_state_1.pt"} <= files
    assert any(name.startswith("fsdp_model_0/__1_") for name in files)  # rank 1's shards, published together
    assert json.loads((tmp_path / "ck" / "a" / "fsdp_checkpoint.json").read_text())["fsdp_version"] == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, inject", [
    ("ddp", "extra"),  # torchbay's own staging copy (a plugin's per-rank state) fails on rank 1
    pytest.param("fsdp", "model", id="fsdp2-model"),  # the strategy's staging (the model's state dict) on rank 1
    pytest.param("fsdp1", "model", id="fsdp1-model"),
])
def test_a_save_that_cannot_start_on_rank_1_is_an_error_on_both_and_the_next_save_works(tmp_path, script, strategy,
                                                                                         inject):
    if strategy != "ddp":
        pytest.importorskip("torchbay_fsdp")
    for r in _run(script, tmp_path, "--mode", "start_fail", "--strategy", strategy, "--inject", inject):
        assert r["raised_at"] == "save_state"  # the save never started: the call itself says so, on every rank
        assert r["error"].startswith("save_state failed on rank 1: ") and "injected on rank 1" in r["error"]
        assert not r["bad_exists"] and not r["bad_partial_exists"]  # nothing published, nothing left behind
        assert r["writers_after_failure"] == []  # no rank started a write that waits for rank 1
        later = r["later"]
        assert later["published"] and later["changed"] and later["equal_at_call"] and not later["done_at_return"]
        assert r["warnings"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [pytest.param("fsdp", id="fsdp2"), pytest.param("fsdp1", id="fsdp1")])
def test_consecutive_fsdp_saves_reuse_their_host_staging_memory(tmp_path, script, strategy):
    pytest.importorskip("torchbay_fsdp")
    for r in _run(script, tmp_path, "--mode", "reuse", "--strategy", strategy):
        assert not r["r1_done_at_return"] and not r["r2_done_at_return"] and r["every_weight_changed"]
        assert r["same_ptrs"] and r["r1_nbytes"] == r["r2_nbytes"] > 0  # the second save allocated nothing
        assert not r["r1_staged_live"] and not r["r2_staged_live"]  # the writers had copies, never live shards
        assert r["r1_equal_at_call"] and r["r2_equal_at_call"]  # each loads as the state at its own call
        assert r["released"] and r["warnings"] == []  # end_training dropped the staging memory
