"""Pipeline parallel (issue 38): the pp settings and their checks, the automatic split, and real gloo runs.

Process launches: scripts/pipeline_train.py with 2 processes (pp 2 with each schedule, with split
points, with gradient accumulation, built on the meta device) and with 4 (pp 2 x dp_shard 2 with a
save_state, pp 2 x tp 2, pp 2 x dp_replicate 2 with save_state(blocking=False), pp 2 x dp_shard 2 with
gradient accumulation: one reduction per window, pp 2 x dp_shard 2 with ZBVZeroBubble), scripts/pipeline_hf.py
with 2 (a tiny Hugging Face Llama at pp 2), then
scripts/pipeline_resume.py with 4 (same shape), 1 (resharded, saving again) and 4 again (from the
one-process checkpoint). Each run is compared with a single-process reference computed in the
worker (same model, seed and batches; AdamW, clip_grad_norm_ 1.0, 3 steps).

Tolerances: micro-batched gradients are summed in another order than the full batch's, so
losses, gradient norms and weights are compared at 1e-5 absolute (observed on this machine:
losses 2.4e-7, norms 6e-8, weights 1.4e-6 after 3 steps; resume at the same shape is exact).
Everything else runs in this process and starts no process group.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from torchbay.testing.processes import run_python, run_torchrun

ATOL = 1e-5
SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
sys.path.insert(0, SCRIPTS)

import pipeline_common as common  # noqa: E402

TWO = ["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "split_points", "accumulate"]
META = "meta_init"
FOUR = ["pp2_dp2", "pp2_tp2", "pp2_ddp2", "pp2_dp2_accumulate", "zbv_dp2"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2")
    run_torchrun(os.path.join(SCRIPTS, "pipeline_train.py"), 2, ["--out", str(out), "--runs", ",".join(TWO + [META])],
                 timeout=400).check()
    return {name: json.loads((out / f"result_{name}.json").read_text()) for name in TWO + [META]}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2dp2")
    run_torchrun(os.path.join(SCRIPTS, "pipeline_train.py"), 4, ["--out", str(out), "--runs", ",".join(FOUR)],
                 timeout=400).check()
    return out, {name: json.loads((out / f"result_{name}.json").read_text()) for name in FOUR}


def _check_matches_reference(got: dict) -> None:
    assert len(got["losses"]) == common.K
    for ranks, ref in zip(got["losses"], got["reference_losses"]):
        assert abs(sum(ranks) / len(ranks) - ref) <= ATOL, (ranks, ref)  # the mean over data-parallel ranks
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(got["reference_norms"]), atol=ATOL, rtol=0)
    assert got["weights_max_diff"] <= ATOL, got["weights_max_diff"]
    assert got["state_keys_in_order"]  # get_state_dict: the full model, its own names, in its order
    assert abs(got["eval_loss"] - got["reference_eval_loss"]) <= ATOL  # forward only (model.eval(), no_grad)
    assert [i for ids in got["gathered_for_metrics"] for i in ids] == list(range(common.K * common.GLOBAL_BATCH))


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", TWO)
def test_pp2_each_schedule_matches_a_single_process(two, run):
    got = two[run]
    _check_matches_reference(got)
    assert all(len(set(ranks)) == 1 for ranks in got["losses"])  # every rank sees the pipeline's loss
    assert (got["mesh_dims"], got["mesh_shape"]) == (["pp", "dp_shard"], [2, 1])


@pytest.mark.multiprocess
def test_each_rank_holds_its_stages_parameters_under_the_models_names(two):
    full = {n for n, _ in common.make_model().named_parameters()}
    for run in TWO:
        names = two[run]["names"]
        assert set(names[0]) | set(names[1]) == full and not set(names[0]) & set(names[1]), run
    first, last = two["1f1b"]["names"]
    assert "emb.weight" in first and "head.weight" in last and "norm.weight" in last
    assert {n.split(".")[1] for n in first if n.startswith("blocks.")} == {"0", "1"}  # balanced: 2 blocks each
    v_first, _ = two["zbv"]["names"]  # V placement: rank 0 holds stages 0 and 3 (the first block and the last)
    assert {n.split(".")[1] for n in v_first if n.startswith("blocks.")} == {"0", "3"} and "head.weight" in v_first
    loop_first, _ = two["interleaved"]["names"]  # looped: rank 0 holds stages 0 and 2
    assert {n.split(".")[1] for n in loop_first if n.startswith("blocks.")} == {"0", "2"}
    split_first, _ = two["split_points"]["names"]  # pp_split_points ["blocks.1"]: stage 0 is block 0 alone
    assert {n.split(".")[1] for n in split_first if n.startswith("blocks.")} == {"0"}
    assert two["split_points"]["param_bytes"][0] < two["split_points"]["param_bytes"][1]


@pytest.mark.multiprocess
def test_a_model_built_on_the_meta_device_is_materialised_stage_by_stage(two):
    got = two[META]
    assert got["on_meta"] == [[], []]  # every tensor a rank holds is real; the other stages' never were
    assert got["param_bytes"] == two["1f1b"]["param_bytes"]
    assert all(loss == loss and 0 < loss < 10 for loss in got["losses"]) and len(got["losses"]) == common.K


@pytest.mark.multiprocess
def test_a_hugging_face_llama_at_pp2_matches_a_single_process(tmp_path):
    pytest.importorskip("transformers")
    run_torchrun(os.path.join(SCRIPTS, "pipeline_hf.py"), 2, ["--out", str(tmp_path)], timeout=400).check()
    got = json.loads((tmp_path / "result_hf.json").read_text())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["reference_losses"]), atol=ATOL, rtol=0)
    assert got["weights_max_diff"] <= ATOL, got["weights_max_diff"]
    first, last = got["names"]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last and "model.norm.weight" in last
    assert not set(first) & set(last)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", FOUR)
def test_pp2_with_data_parallel_matches_a_single_process(four, run):
    _, result = four
    got = result[run]
    _check_matches_reference(got)
    dims = {"pp2_dp2": (["pp", "dp_shard"], [2, 2]), "pp2_ddp2": (["pp", "dp_replicate", "dp_shard"], [2, 2, 1]),
            "pp2_tp2": (["pp", "dp_shard", "tp"], [2, 1, 2]), "pp2_dp2_accumulate": (["pp", "dp_shard"], [2, 2]),
            "zbv_dp2": (["pp", "dp_shard"], [2, 2])}
    assert (got["mesh_dims"], got["mesh_shape"]) == dims[run]
    if run == "pp2_dp2":  # each stage sharded over its 2 data-parallel ranks: half a pp 2 rank's bytes
        assert got["param_bytes"] == [b // 2 for b in [28160, 28160, 28416, 28416]]
    if run == "pp2_dp2_accumulate":  # gradients reduced once per window: none on any rank before its last step
        assert got["grads_mid_window"] == [False] * (common.K * 4), got["grads_mid_window"]
    if run == "pp2_tp2":  # the blocks split over tp (embedding, norms and head whole)
        assert got["param_bytes"] == [15488, 15488, 15744, 15744]


def _resume(out, nprocs: int, sizes: str, *extra: str) -> dict:
    script = os.path.join(SCRIPTS, "pipeline_resume.py")
    args = ["--out", str(out), "--sizes", sizes, *extra]
    (run_torchrun(script, nprocs, args, timeout=400) if nprocs > 1 else run_python(script, args, timeout=400)).check()
    suffix = "_back" if "--ckpt" in extra else ""
    return json.loads((out / f"result_resume_{sizes}{suffix}.json").read_text())


@pytest.mark.multiprocess
def test_resume_at_pp2_dp2_is_exact_and_the_checkpoint_reshards_to_one_process_and_back(four):
    out, result = four
    same = _resume(out, 4, "pp2_dp2")
    assert same["weights_max_diff"] == 0.0 and same["uninterrupted_same_keys"]
    one = _resume(out, 1, "one", "--save-to", str(out / "one_ckpt"))
    assert one["weights_max_diff"] <= ATOL and one["uninterrupted_same_keys"]
    back = _resume(out, 4, "pp2_dp2", "--ckpt", str(out / "one_ckpt"))
    assert back["weights_max_diff"] <= ATOL and back["uninterrupted_same_keys"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("run,folder", [("pp2_dp2", "ckpt"), ("pp2_ddp2", "ckpt_async")])
def test_merge_weights_writes_the_full_model_of_a_pipeline_checkpoint(four, run, folder):
    """pp2_ddp2 saved with save_state(blocking=False)."""
    from safetensors.torch import load_file

    from torchbay.testing.cli import run_command

    out, _ = four
    assert run_command("merge-weights", str(out / folder), str(out / f"{folder}_merged")) == 0
    merged = load_file(str(out / f"{folder}_merged" / "model.safetensors"))
    expected = torch.load(out / f"{run}_weights_at_S.pt", weights_only=True)
    assert set(merged) == set(expected) and all(torch.equal(merged[k], expected[k]) for k in expected)
    common.make_model().load_state_dict(merged)  # loads into the plain model


# --- no process group: the settings, their checks and the split --------------------------------------


def test_parallelism_config_takes_pp_and_refuses_schedules_the_sizes_cannot_run():
    from torchbay import ConfigError, ParallelismConfig

    pc = ParallelismConfig(pp_size=2, dp_shard_size=2, pp_schedule="Interleaved1F1B", pp_microbatches=4)
    assert pc.sizes == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 1} and pc.total_size == 4
    assert pc.to_config()["parallelism.pp_schedule"] == "Interleaved1F1B"
    assert ParallelismConfig().pp_size == 1
    with pytest.raises(ConfigError, match="pp_schedule 'Zigzag' is not a pipeline schedule; use one of GPipe"):
        ParallelismConfig(pp_size=2, pp_schedule="Zigzag")
    with pytest.raises(ConfigError, match="1F1B needs at least as many micro-batches as pipeline stages.*>= 4"):
        ParallelismConfig(pp_size=4, pp_schedule="1F1B", pp_microbatches=2)
    with pytest.raises(ConfigError, match="ZBVZeroBubble places exactly 2 stages per rank.*pp_virtual_stages 2"):
        ParallelismConfig(pp_size=2, pp_schedule="ZBVZeroBubble", pp_virtual_stages=3)
    with pytest.raises(ConfigError, match="GPipe runs one stage per rank but pp_virtual_stages is 2"):
        ParallelismConfig(pp_size=2, pp_schedule="GPipe", pp_virtual_stages=2)
    with pytest.raises(ConfigError, match="Interleaved1F1B needs a multiple of pp_size"):
        ParallelismConfig(pp_size=2, pp_schedule="Interleaved1F1B", pp_microbatches=5)
    with pytest.raises(ConfigError, match="pp_size is 1 .no pipeline.; set pp_size > 1 or remove them"):
        ParallelismConfig(pp_microbatches=4)
    with pytest.raises(ConfigError, match="pp_size=0.*at least 1"):
        ParallelismConfig(pp_size=0)


def _problems(world: int, **args) -> list[str]:
    from test_parallelism import _problems as problems

    return problems(world, **args)


def test_bad_pipeline_combinations_are_refused_before_any_process_with_their_fix():
    from test_parallelism import _context

    assert _context(4, **{"parallelism.pp_size": 2}).strategy_cls.name == "fsdp"  # dp_shard takes the rest
    assert _context(4, **{"parallelism.pp_size": 2, "parallelism.dp_replicate_size": 2}).strategy_cls.name == "fsdp"
    assert _context(4, **{"parallelism.pp_size": 2, "parallelism.pp_schedule": "ZBVZeroBubble"}).strategy_cls.name \
        == "fsdp"  # zero bubble with data parallel (dp_shard 2)
    text = "\n".join(_problems(3, **{"parallelism.pp_size": 2}))
    assert "pp_size 2 does not divide the 3 processes" in text
    text = "\n".join(_problems(4, **{"parallelism.pp_size": 2, "parallelism.cp_size": 2}))
    assert "with cp_size > 1 is not supported yet" in text
    text = "\n".join(_problems(2, mixed_precision="fp16", **{"parallelism.pp_size": 2}))
    assert "mixed_precision fp16" in text and "use bf16" in text
    text = "\n".join(_problems(2, **{"parallelism.pp_size": 2, "fsdp.version": 1}))
    assert "needs fsdp.version 2" in text
    (problem,) = _problems(2, strategy="ddp", **{"parallelism.pp_size": 2})
    assert problem.startswith("strategy 'ddp' cannot build the parallel dimension(s) pp") and "fsdp" in problem


def test_the_split_balances_blocks_by_parameters_with_embeddings_first_and_the_head_last():
    from torchbay_fsdp.pipeline.split import balance, plan_split, stage_parameter_counts

    with torch.device("meta"):  # a plan needs no weights
        model = common.make_model()
    plan = plan_split(model, 2)
    assert (plan.blocks, plan.pre, plan.post, plan.ranges) == ("blocks", ("emb",), ("norm", "head"), ((0, 2), (2, 4)))
    assert stage_parameter_counts(model, plan) == [7040, 7104]
    assert plan_split(model, 4).ranges == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert plan_split(model, 2, ["blocks.3"]).ranges == ((0, 3), (3, 4))
    assert balance([1, 1, 1, 10], 2) == [(0, 3), (3, 4)]
    assert balance([5, 1, 1, 1], 2, head=0, tail=6) == [(0, 3), (3, 4)]


def test_models_and_split_points_the_split_cannot_use_are_refused_with_the_fix():
    from torchbay_fsdp.pipeline.split import plan_split

    from torchbay import ConfigError

    model = common.make_model()
    with pytest.raises(ConfigError, match=r"pp_split_points: 'blocks\.9' is not a block.*blocks\.1 \.\.\. blocks\.3"):
        plan_split(model, 2, ["blocks.9"])
    with pytest.raises(ConfigError, match=r"pp_split_points: 'head' is not a block"):
        plan_split(model, 2, ["head"])
    with pytest.raises(ConfigError, match="names 2 points but 2 stages need 1"):
        plan_split(model, 2, ["blocks.1", "blocks.2"])
    with pytest.raises(ConfigError, match="has 4 blocks, fewer than the 8 pipeline stages"):
        plan_split(model, 8)
    with pytest.raises(ConfigError, match=r"Sequential has no block list .* set parallelism.pp_size 1"):
        plan_split(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), 2)
    tied = common.make_model()
    tied.head.weight = tied.emb.weight  # an output head tied to the input embedding, as many language models do
    with pytest.raises(ConfigError, match=r"ties emb\.weight and head\.weight .* stages \[0, 1\].*tie_word_embeddings"):
        plan_split(tied, 2)
    assert plan_split(tied, 1).num_stages == 1  # one stage holds both: nothing to refuse


def test_stage_placement_and_theoretical_bubble_follow_torchs_schedules():
    from torchbay_fsdp.pipeline.schedule import stage_indices, theoretical_bubble

    assert [stage_indices("1F1B", r, 2, None) for r in range(2)] == [[0], [1]]
    assert [stage_indices("Interleaved1F1B", r, 2, None) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_indices("ZBVZeroBubble", r, 2, None) for r in range(2)] == [[0, 3], [1, 2]]
    assert theoretical_bubble("GPipe", 2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble("Interleaved1F1B", 2, 4) == pytest.approx(1 / 9)


def test_estimate_memory_takes_pp_size_and_counts_the_largest_stage(tmp_path, monkeypatch, capsys):
    from torchbay.testing.cli import run_command

    (tmp_path / "pipe_gpt_factory.py").write_text(
        f"import sys\nsys.path.insert(0, {SCRIPTS!r})\nfrom pipeline_common import PipeGPT\n"
        f"def build():\n    return PipeGPT()\n")
    monkeypatch.chdir(tmp_path)
    assert run_command("estimate-memory", "pipe_gpt_factory:build", "--num-processes", "4", "--pp-size", "2",
                 "--dp-shard-size", "2", "--format", "json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parallelism"]["pp"] == 2
    rows = {(r["strategy"], r["precision"]): r for r in report["rows"]}
    assert rows[("fsdp", "no")]["parameters"] == 7104 * 4 // 2  # the last stage's, sharded over dp_shard 2
    assert "per pp rank 7,040 / 7,104 params" in rows[("fsdp", "no")]["note"]
    assert rows[("fsdp", "fp16")]["note"].startswith("refused: pipeline parallel with fp16")
    assert rows[("ddp", "-")]["note"].startswith("cannot build the parallel dimension(s) pp")
    # pp_size alone: dp_shard takes the processes left, as at run time (4 processes: pp 2 x dp_shard 2)
    assert run_command("estimate-memory", "pipe_gpt_factory:build", "--num-processes", "4", "--pp-size", "2",
                       "--format", "json") == 0
    alone = {(r["strategy"], r["precision"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert alone[("fsdp", "no")]["parameters"] == rows[("fsdp", "no")]["parameters"]


def test_the_launch_set_up_line_shows_the_mesh_the_strategy_builds(tmp_path, capsys):
    from torchbay.testing.cli import run_command

    script = tmp_path / "train.py"
    script.write_text("print('never run by --dry-run')\n")
    assert run_command("launch", "--dry-run", "--strategy", "fsdp", "--num-processes", "4", "--pp-size", "2",
                       str(script)) == 0
    assert "mesh pp 2 x dp_shard 2 (pp schedule 1F1B)" in capsys.readouterr().out  # dp_shard: the processes left


def _live(marker: str) -> list[str]:
    """Live processes whose command line holds ``marker`` (from /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z" and int(entry) != os.getpid():
            found.append(cmd)
    return found


@pytest.mark.multiprocess
def test_a_rank_failing_inside_the_schedule_is_named_with_its_stage_and_no_process_is_left(tmp_path):
    import shutil
    import subprocess

    script = tmp_path / "pipeline_fail.py"  # its path marks the job's processes
    shutil.copy(os.path.join(SCRIPTS, "pipeline_fail.py"), script)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), SCRIPTS]))}
    env.pop("TORCHBAY_RESOLVED_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "torchbay.cli.main", "launch", "--num-processes", "2", str(script)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 1, done.stderr[-3000:]
    report = done.stderr[done.stderr.index("torchbay launch: rank"):]
    assert report.startswith("torchbay launch: rank 1 failed first"), report[:2000]
    assert "ValueError: deliberate failure inside the pipeline schedule" in report
    assert "inside the pipeline schedule 1F1B (training step), on the rank holding pipeline stage(s) 1 of 2" in report
    then = report.split("then:", 1)[1]
    assert "rank 0" in then and "a consequence of the first failure" in then
    assert not _live(str(tmp_path)), "no rank may outlive the launcher"
