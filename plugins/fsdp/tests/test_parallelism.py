"""N-D parallelism (issue 17): ParallelismConfig, the fsdp plugin's named DeviceMesh, HSDP, tensor
parallel on any module, the data loader's data-parallel split, resharding checkpoints, errors.

Three process launches in all: plugins/fsdp/tests/scripts/parallel_train.py with 4 processes (FSDP 4, HSDP
2x2, FSDP 2 x TP 2 with the Megatron plan and FSDP 2 x TP 2 with every other style, side by
side against a single-process reference computed in the worker, and a save_state at 2 x 2), then
parallel_resume.py with 4 (dp_shard 4) and with 1 process.
Everything else runs in this process and starts no process group.

Tolerances: the N-D runs reduce gradients in another order than the single-process
reference (mean of per-rank means, sharded all-reduces), so losses and weights are compared
at 1e-5 (absolute; observed on this machine: losses 2.4e-7, weights 2e-7 / 3.9e-7 / 8.9e-7 for
FSDP 4 / HSDP / FSDP x TP after 4 AdamW steps).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from torchbay.testing.processes import run_torchrun

ATOL = 1e-5
SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
sys.path.insert(0, SCRIPTS)

import parallel_common as common  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    run_torchrun(os.path.join(SCRIPTS, "parallel_train.py"), 4, ["--out", str(out)], timeout=400).check()
    return out, json.loads((out / "result_train.json").read_text())


def _close(a, b, atol=ATOL):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


# --- training matches one process ------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["fsdp4", "hsdp", "fsdp2_tp2", "fsdp2_tp2_every_style"])
def test_loss_and_weights_after_k_steps_match_a_single_process(trained, run):
    _, result = trained
    got = result[run]
    assert len(got["losses"]) == common.K
    _close(got["losses"], got["reference_losses"])
    assert got["weights_max_diff"] <= ATOL, got["weights_max_diff"]


@pytest.mark.multiprocess
def test_one_named_mesh_with_the_active_and_flattened_dimensions(trained):
    _, result = trained
    assert (result["fsdp4"]["mesh_dims"], result["fsdp4"]["mesh_shape"]) == (["dp_shard"], [4])
    assert (result["hsdp"]["mesh_dims"], result["hsdp"]["mesh_shape"]) == (["dp_replicate", "dp_shard"], [2, 2])
    tp = result["fsdp2_tp2"]
    assert (tp["mesh_dims"], tp["mesh_shape"]) == (["dp_shard", "tp"], [2, 2])
    assert (tp["dp_mesh_size"], tp["dp_shard_cp_size"], tp["dp_cp_size"]) == (2, 2, 2)
    assert (result["hsdp"]["dp_mesh_size"], result["hsdp"]["dp_shard_cp_size"]) == (4, 2)
    assert tp["tp_rank"] == [0, 1, 0, 1]  # tp innermost, as Accelerate and torchtitan order the mesh
    assert tp["parallelism_config_sizes"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}
    assert all(result[run]["config_mesh_is_accelerator_mesh"] for run in ("fsdp4", "hsdp", "fsdp2_tp2"))
    assert tp["tp_plan_applied"] == sorted(f"blocks.{i}.{m}" for i in range(common.BLOCKS)
                                           for m in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down"))


@pytest.mark.multiprocess
def test_every_style_string_hands_on_and_splits_what_its_name_says(trained):
    """The styles the Megatron plan does not use, on a model written for sequence parallelism
    (its losses and weights match one process: see the test above)."""
    _, result = trained
    got = result["fsdp2_tp2_every_style"]
    assert got["tp_plan_applied"] == ["down", "head", "norm", "pre_down", "pre_up", "to_seq", "up"]
    batch, seq, dim = common.GLOBAL_BATCH // 2, common.SEQ, common.DIM
    assert got["outputs"] == {
        "emb": f"Tensor({[batch, seq, dim]})",  # not in the plan
        "pre_up": f"Tensor({[batch, seq, 2 * dim]})",  # colwise_rep: every feature, a plain tensor
        "pre_down": f"Tensor({[batch, seq, dim]})",  # rowwise_rep: took the whole input
        "to_seq": "DTensor(S(1))",  # the torch ParallelStyle object: the sequence split over tp
        "norm": "DTensor(S(1))",  # sequence_parallel: stays on the sequence shards
        "up": "DTensor(S(2))",  # local_colwise: a DTensor sharded on the features
        "down": "DTensor(R)",  # local_rowwise: a replicated DTensor
        "head": f"Tensor({[batch, seq, common.VOCAB]})",  # replicate: plain tensor out
    }
    # [dp_shard placement, tp placement]: colwise splits output features (dim 0), rowwise input
    # features (dim 1, its bias whole); sequence_parallel and replicate keep the tp copy whole
    tp = {name: placements[1] if len(placements) == 2 else None for name, placements in got["placements"].items()}
    assert tp == {"emb.weight": None,
                  "pre_up.weight": "S(0)", "pre_up.bias": "S(0)", "pre_down.weight": "S(1)", "pre_down.bias": "R",
                  "to_seq.weight": "S(1)", "to_seq.bias": "R", "norm.weight": "R", "norm.bias": "R",
                  "up.weight": "S(0)", "up.bias": "S(0)", "down.weight": "S(1)", "down.bias": "R",
                  "head.weight": "R", "head.bias": "R"}


@pytest.mark.multiprocess
def test_tp_group_ranks_read_the_same_batch_and_dp_ranks_split_the_global_batch(trained):
    _, result = trained
    for run, dp in (("fsdp4", 4), ("hsdp", 4), ("fsdp2_tp2", 2)):
        got = result[run]
        assert got["data_parallel_size"] == dp
        for step, per_rank in enumerate(got["seen"]):
            parts = {}
            for rank, ids in enumerate(per_rank):
                dp_rank = got["data_parallel_rank"][rank]
                assert parts.setdefault(dp_rank, ids) == ids, (run, step, rank)  # same batch within a tp group
            everything = sorted(i for ids in parts.values() for i in ids)
            assert everything == list(range(step * common.GLOBAL_BATCH, (step + 1) * common.GLOBAL_BATCH)), (run, step)
            # gather_for_metrics returns each sample once, in data-parallel order (tensors and objects)
            for gathered in got["gathered_for_metrics"][2 * step:2 * step + 2]:
                assert gathered == [i for dp_rank in sorted(parts) for i in parts[dp_rank]], (run, step)
    assert result["fsdp2_tp2"]["data_parallel_rank"] == [0, 0, 1, 1]
    assert result["fsdp2_tp2"]["free_function_first_ids"] == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]


def _tp_split(name: str) -> bool:
    """Whether tensor parallel splits parameter ``name``: colwise splits weight and bias, rowwise
    only the weight (torch keeps a rowwise bias replicated: it is added after the all-reduce)."""
    import fnmatch

    module, leaf = name.rsplit(".", 1)
    style = next((s for p, s in common.PLAN.items() if fnmatch.fnmatchcase(module, p)), None)
    return style == "colwise" or (style == "rowwise" and leaf == "weight")


@pytest.mark.multiprocess
def test_parameter_bytes_per_rank_shrink_as_the_plan_says(trained):
    """Every parameter counted, those tp leaves whole (embedding, norms, head) included."""
    _, result = trained
    full = result["full_param_bytes"]
    total = sum(full.values())
    assert result["fsdp4"]["param_bytes"] == [total // 4] * 4
    assert result["hsdp"]["param_bytes"] == [total // 2] * 4  # sharded over 2, each replica a copy
    split = sum(v for k, v in full.items() if _tp_split(k))
    assert 0 < split < total
    expected = split // 4 + (total - split) // 2  # tp-split layers: dp_shard 2 x tp 2; the rest: dp_shard 2
    assert result["fsdp2_tp2"]["param_bytes"] == [expected] * 4


# --- checkpoints across mesh shapes ------------------------------------------------------------


@pytest.mark.multiprocess
def test_save_state_at_shard2_tp2_writes_dcp_shards_and_the_mesh(trained):
    out, _ = trained
    info = json.loads((out / "ckpt" / "fsdp_checkpoint.json").read_text())
    assert info["mesh"] == {"dp_shard": 2, "tp": 2} and info["world_size"] == 4
    assert sorted(p.name for p in (out / "ckpt" / "fsdp_model_0").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [4, 1])
def test_load_state_reshards_shard2_tp2_into_shard4_and_one_process(trained, world):
    out, result = trained
    run_torchrun(os.path.join(SCRIPTS, "parallel_resume.py"), world, ["--out", str(out)], timeout=300).check()
    got = json.loads((out / f"result_resume_{world}.json").read_text())
    assert got["mesh_dims"] == ["dp_shard"] and got["mesh_shape"] == [world]
    assert got["loaded_max_diff"] == 0.0  # the weights saved at step S, exactly
    _close(got["losses"], result["fsdp2_tp2"]["uninterrupted_losses"])  # optimizer state came along
    assert got["weights_max_diff"] <= ATOL


@pytest.mark.multiprocess
def test_merge_weights_turns_an_nd_checkpoint_into_one_safetensors_model(trained, tmp_path):
    from safetensors.torch import load_file
    from torchbay_fsdp.merge import merge_weights

    out, _ = trained
    merge_weights(out / "ckpt", tmp_path / "merged")
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    saved = torch.load(out / "ckpt_weights.pt", weights_only=True)
    assert set(merged) == set(saved)
    assert all(torch.equal(merged[k], saved[k]) for k in saved)
    model = common.make_model(seed=3)
    model.load_state_dict(merged)  # loads into the plain model


# --- ParallelismConfig: Accelerate's fields and rules ------------------------------------------


def test_parallelism_config_has_accelerates_fields_properties_and_rules():
    from torchbay import ConfigError, ParallelismConfig
    from torchbay.utils import ParallelismConfig as FromUtils
    from torchbay.utils import TorchContextParallelConfig, TorchTensorParallelConfig

    assert FromUtils is ParallelismConfig
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=2)
    assert pc.total_size == 16 and pc.data_parallel_size == 4 and pc.non_data_parallel_size == 4
    assert pc.active_mesh_dims == ["dp_replicate", "dp_shard", "tp", "cp"]  # Accelerate's order (the mesh: _get_mesh)
    assert (pc.dp_dim_names, pc.non_dp_dim_names) == (["dp_replicate", "dp_shard"], ["tp", "cp"])
    assert (pc.dp_shard_cp_dim_names, pc.dp_cp_dim_names) == (["dp_shard", "cp"], ["dp_replicate", "dp_shard", "cp"])
    assert pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert isinstance(pc.tp_handler, TorchTensorParallelConfig) and pc.cp_handler.cp_comm_strategy == "allgather"
    assert ParallelismConfig().total_size == 1 and not ParallelismConfig().tp_enabled
    assert ParallelismConfig(tp_size=2, tp_plan={"a": "colwise"}).to_config() == {
        "parallelism.dp_replicate_size": 1, "parallelism.dp_shard_size": 1, "parallelism.cp_size": 1,
        "parallelism.sp_size": 1, "parallelism.tp_size": 2, "parallelism.tp_plan": {"a": "colwise"}}
    with pytest.raises(ConfigError, match="tp_size=0.*at least 1"):
        ParallelismConfig(tp_size=0)
    with pytest.raises(ConfigError, match="set dp_shard_size instead of dp_replicate_size"):
        ParallelismConfig(dp_replicate_size=2, tp_size=2)  # TP/CP on plain DDP: Accelerate's rule
    with pytest.raises(ConfigError, match="cp_size 2 and sp_size 2 both shard the sequence"):
        ParallelismConfig(sp_size=2, cp_size=2)  # sp itself: test_ulysses.py
    with pytest.raises(ConfigError, match="cp_backend"):
        ParallelismConfig(cp_backend="ring")
    with pytest.raises(ConfigError, match="cp_comm_strategy"):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    with pytest.raises(ConfigError, match="enable_async_tp"):
        TorchTensorParallelConfig(enable_async_tp=True)
    with pytest.raises(ConfigError, match="get_device_mesh.*pass the device type.*torch_device_mesh"):
        ParallelismConfig(dp_shard_size=2).get_device_mesh()


class _Cluster:
    """A job of ``world`` processes, seen from rank 0 (validation needs no process)."""

    def __init__(self, world: int):
        self.world = world

    def world_size(self):
        return self.world

    def rank(self):
        return 0

    def local_rank(self):
        return 0

    def local_world_size(self):
        return self.world


def _context(world: int, **args):
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config
    from torchbay.registry.selection import build_context

    pm = get_plugin_manager()
    resolved = resolve_config(environ={}, args={"strategy": "fsdp", "device": "cpu", **args}, pm=pm)
    return build_context(resolved, pm, cluster=_Cluster(world))


def _problems(world: int, **args) -> list[str]:
    from torchbay.errors import IncompatibleSetupError

    with pytest.raises(IncompatibleSetupError) as info:
        _context(world, **args)
    return info.value.problems


def test_sizes_that_do_not_multiply_to_the_world_size_are_refused_before_any_process():
    assert _context(4, **{"parallelism.dp_shard_size": 2, "parallelism.tp_size": 2}).strategy_cls.name == "fsdp"
    (problem,) = _problems(8, **{"parallelism.dp_shard_size": 2, "parallelism.tp_size": 2})
    assert "dp_shard_size 2 x tp_size 2 = 4 processes, but this run has 8" in problem
    assert "make the sizes multiply to 8" in problem


def test_strategies_that_cannot_build_a_dimension_refuse_it_and_name_one_that_can():
    (problem,) = _problems(4, strategy="ddp", **{"parallelism.dp_shard_size": 2, "parallelism.tp_size": 2})
    assert problem.startswith("strategy 'ddp' cannot build the parallel dimension(s) dp_shard, tp")
    assert "select strategy: fsdp" in problem
    # dp_replicate alone is plain data parallelism: ddp builds it
    assert _context(4, strategy="ddp", **{"parallelism.dp_replicate_size": 4}).strategy_cls.name == "ddp"
    # strategy auto: ddp, unless the parallelism section asks for dimensions ddp does not build
    assert _context(4, strategy="auto").strategy_cls.name == "ddp"
    assert _context(4, strategy="auto", **{"parallelism.dp_replicate_size": 4}).strategy_cls.name == "ddp"
    assert _context(4, strategy="auto", **{"parallelism.dp_shard_size": 2,
                                           "parallelism.tp_size": 2}).strategy_cls.name == "fsdp"
    assert _context(2, strategy="auto", **{"parallelism.sp_size": 2}).strategy_cls.name == "fsdp"
    from torchbay.registry.manager import get_plugin_manager

    if "deepspeed" in get_plugin_manager().registries()["strategies"]:
        problems = _problems(4, strategy="deepspeed", **{"parallelism.dp_shard_size": 4})
        assert any(p.startswith("strategy 'deepspeed' cannot build the parallel dimension(s) dp_shard")
                   for p in problems), problems


def test_context_parallel_on_cpu_is_refused_in_one_line():
    from torchbay.errors import IncompatibleSetupError

    with pytest.raises(IncompatibleSetupError) as info:
        _context(2, **{"parallelism.cp_size": 2})
    assert len(info.value.problems) == 1
    message = info.value.problems[0]
    assert "\n" not in message and "context parallel is unavailable on device 'cpu'" in message
    assert "scaled_dot_product_attention" in message and "set cp_size 1" in message


def test_fsdp_refuses_mesh_shapes_it_cannot_shard_and_bad_plans_with_their_fix():
    text = "\n".join(_problems(4, **{"parallelism.dp_replicate_size": 4}))
    assert "dp_shard_size and cp_size are both 1" in text and "use strategy: ddp" in text
    text = "\n".join(_problems(4, **{"parallelism.tp_plan": {"blocks.*.up": "colwise"}}))
    assert "tp_plan is set but parallelism.tp_size is 1" in text
    text = "\n".join(_problems(4, **{"parallelism.dp_shard_size": 2, "parallelism.tp_size": 2,
                                     "parallelism.tp_plan": {"blocks.*.up": "gather"}}))
    assert "'gather' is not a style torchbay supports" in text and "colwise, rowwise" in text


def _resolve(model, plan, tp_size=2):
    from torchbay_fsdp.tensor_parallel import resolve_plan

    return resolve_plan(model, plan, tp_size, "parallelism.tp_plan")


def test_tp_plan_patterns_resolve_per_module_and_bad_plans_name_the_module_and_fix():
    from torchbay.errors import ConfigError

    model = common.make_model()
    resolved = _resolve(model, common.PLAN)
    assert len(resolved) == 6 * common.BLOCKS and resolved["blocks.1.attn.o"] == "rowwise"
    with pytest.raises(ConfigError, match=r"'blocks\.\*\.ffn\.up'\] matches no module of TinyGPT"):
        _resolve(model, {"blocks.*.ffn.up": "colwise"})
    with pytest.raises(ConfigError, match="out_features 16 over parallelism.tp_size 3, which does not divide it"):
        _resolve(model, {"blocks.*.attn.q": "colwise"}, tp_size=3)
    with pytest.raises(ConfigError, match="in_features 64 over parallelism.tp_size 3"):
        _resolve(model, {"blocks.0.mlp.down": "rowwise"}, tp_size=3)
    with pytest.raises(ConfigError, match="is a LayerNorm; colwise splits only nn.Linear and nn.Embedding"):
        _resolve(model, {"norm": "colwise"})
    with pytest.raises(ConfigError, match="'shard_everything' is not a style"):
        _resolve(model, {"head": "shard_everything"})


def test_a_models_own_tp_plan_is_used_when_none_is_given():
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torchbay_fsdp.tensor_parallel import model_plan, to_style

    model = common.make_model()
    model.blocks[0]._tp_plan = {"mlp.up": "colwise", "mlp.down": "rowwise"}  # as Hugging Face models carry one
    assert model_plan(model) == {"blocks.0.mlp.up": "colwise", "blocks.0.mlp.down": "rowwise"}
    model.tp_plan = {"blocks.*.mlp.up": "colwise"}
    assert model_plan(model) == {"blocks.*.mlp.up": "colwise"}
    style = ColwiseParallel()
    assert to_style(style) is style and _resolve(model, {"head": style})["head"] is style


# --- config sources and CLI --------------------------------------------------------------------


def test_yaml_accelerator_argument_and_launch_flags_feed_the_parallelism_section(tmp_path):
    import argparse

    from torchbay import ParallelismConfig
    from torchbay.accelerator.surface import translate
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    path = tmp_path / "c.yaml"
    path.write_text("strategy: fsdp\nparallelism:\n  dp_shard_size: 2\n  tp_size: 2\n"
                    "  tp_plan: {'blocks.*.mlp.up': colwise}\n")
    config = resolve_config(environ={}, file=str(path), pm=pm).config
    assert (config.parallelism.dp_shard_size, config.parallelism.tp_size) == (2, 2)
    assert config.parallelism.tp_plan == {"blocks.*.mlp.up": "colwise"}
    assert translate({"parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)})[
        "parallelism.dp_replicate_size"] == 2
    parser = argparse.ArgumentParser()
    pm.hook.torchbay_add_cli_options.call_historic(kwargs={"parser": parser, "command": "launch"})
    args = vars(parser.parse_args(["--dp-shard-size", "2", "--tp-size", "2",
                                   "--tp-plan", "blocks.*.mlp.up=colwise,blocks.*.mlp.down=rowwise"]))
    assert args == {"parallelism.dp_shard_size": 2, "parallelism.tp_size": 2,
                    "parallelism.tp_plan": {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}}
    resolved = resolve_config(environ={}, cli=args, pm=pm)
    assert resolved.source_of("parallelism.tp_size") == "cli"


def test_accelerator_refuses_a_parallelism_config_that_does_not_fit_one_process():
    from torchbay import Accelerator, IncompatibleSetupError, ParallelismConfig

    with pytest.raises(IncompatibleSetupError, match="dp_shard_size 2 x tp_size 2 = 4 processes, but this run has 1"):
        Accelerator(strategy="fsdp", parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))


def test_memory_estimate_divides_by_the_parallel_sizes():
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    fsdp = pm.registries()["strategies"]["fsdp"]
    counts = {"parameters": 1600, "trainable": 1600}

    def estimate(**sizes):
        args = {"strategy": "fsdp", **{f"parallelism.{k}_size": v for k, v in sizes.items()}}
        return fsdp.estimate_memory(resolve_config(environ={}, args=args, pm=pm).config, 4, counts)

    assert estimate().parameters == 1600  # all sizes 1: sharded over the 4 processes
    assert estimate(dp_replicate=2, dp_shard=2).parameters == 3200  # a copy per replica
    tp = estimate(dp_shard=2, tp=2)
    assert tp.parameters == 1600 and "lower bound" in tp.note
    known = fsdp.estimate_memory(resolve_config(environ={}, args={"strategy": "fsdp", "parallelism.dp_shard_size": 2,
                                                                  "parallelism.tp_size": 2}, pm=pm).config, 4,
                                 {**counts, "tp_split": 800})
    assert known.parameters == (800 // 4 + 800 // 2) * 4 and known.note == ""


def test_estimate_memory_command_takes_the_parallel_sizes_and_counts_what_the_plan_splits(tmp_path, monkeypatch,
                                                                                          capsys):
    from torchbay.cli.main import main

    (tmp_path / "tiny_gpt_factory.py").write_text(
        f"import sys\nsys.path.insert(0, {SCRIPTS!r})\nfrom parallel_common import TinyGPT\n"
        f"def build():\n    return TinyGPT()\n")
    monkeypatch.chdir(tmp_path)
    plan = ",".join(f"{k}={v}" for k, v in common.PLAN.items())
    assert main(["estimate-memory", "tiny_gpt_factory:build", "--num-processes", "4", "--dp-shard-size", "2",
                 "--tp-size", "2", "--tp-plan", plan, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parallelism"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}
    rows = {(r["strategy"], r["precision"]): r for r in report["rows"]}
    assert rows[("ddp", "-")]["note"] == "cannot build the parallel dimension(s) dp_shard, tp"
    model = common.make_model()
    split = sum(p.numel() for n, p in model.named_parameters() if _tp_split(n))
    total = sum(p.numel() for p in model.parameters())
    assert rows[("fsdp", "no")]["parameters"] == (split // 4 + (total - split) // 2) * 4  # as measured per rank


def test_accelerate_config_parallelism_section_imports_into_the_parallelism_section(tmp_path):
    from torchbay.cli.main import main

    source = tmp_path / "accelerate.yaml"
    source.write_text("distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\n"
                      "parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n"
                      "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
                      "  parallelism_config_cp_size: 1\n  parallelism_config_cp_backend: torch\n")
    assert main(["config", "import-accelerate", str(source), "-o", str(tmp_path / "torchbay.yaml")]) == 0
    import yaml

    written = yaml.safe_load((tmp_path / "torchbay.yaml").read_text())
    assert written["parallelism"] == {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 2, "cp_size": 1}


def _accelerators() -> int:
    from torchbay.registry.manager import get_plugin_manager

    cuda = get_plugin_manager().registries()["devices"].get("cuda")
    return cuda.device_count() if cuda is not None and cuda.unavailable_reason() is None else 0


@pytest.mark.multiprocess
@pytest.mark.skipif(_accelerators() < 2, reason="context parallel needs 2 accelerator devices (torch has no CPU "
                                                "sharding rule for SDPA)")
def test_context_parallel_on_two_accelerators_matches_one_device(tmp_path):
    run_torchrun(os.path.join(SCRIPTS, "parallel_cp.py"), 2, ["--out", str(tmp_path)], timeout=300).check()
    got = json.loads((tmp_path / "result_cp.json").read_text())
    assert got["mesh_dims"] == ["cp"]
    _close(got["losses"], got["reference_losses"], atol=1e-4)  # flash/efficient SDPA kernels: another order
    assert got["weights_max_diff"] <= 1e-4
