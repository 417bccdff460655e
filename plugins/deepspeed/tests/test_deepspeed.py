"""torchbay-deepspeed: real DeepSpeed (its CPU accelerator, gloo) in 2-process groups.

Two 2-process launches and one plain process in all: plugins/deepspeed/tests/scripts/deepspeed_train.py (DDP
against ZeRO-1/2/3 with and without gradient accumulation, ZeRO-2 with optimizer offload, a
DeepSpeed JSON with "auto" values against the same settings in torchbay's config,
DeepSpeed's own optimizer and scheduler from JSON); plugins/deepspeed/tests/scripts/deepspeed_state.py (ZeRO-3
student/teacher under zero.Init, prepared in separate calls, save_state/load_state resume,
save_model); the same script in one plain process loading that 2-process checkpoint through
DeepSpeed's universal checkpoint. The other tests run in this process or a plain subprocess
and start no process group.

Tolerances: DeepSpeed's ZeRO-0/1/2/3 reduce-scatter / all-reduce and DDP's all-reduce both average
the two ranks' fp32 gradients, in a different order, and DeepSpeed's clipping puts its
1e-6 epsilon at another place than torch's clip_grad_norm_; after 8 micro-batches losses,
gradient norms, learning rates and weights agree to 1e-6 absolute (observed: at most 1.2e-7).
The JSON-vs-torchbay-config run and the resumed-vs-uninterrupted run must be bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torchbay.testing.processes import run_torchrun

HERE = os.path.dirname(__file__)
SCRIPTS = os.path.join(HERE, "scripts")
TOL = 1e-6
NO_DS = {"TORCHBAY_DISABLE_PLUGIN_AUTOLOAD": "0"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed_train")
    run_torchrun(os.path.join(SCRIPTS, "deepspeed_train.py"), 2, ["--out", str(out)], timeout=280).check()
    return json.loads((out / "result_train.json").read_text())


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed_state")
    run_torchrun(os.path.join(SCRIPTS, "deepspeed_state.py"), 2, ["--out", str(out), "--stage", "3"],
                 timeout=240).check()
    result = json.loads((out / "result_state_zero3.json").read_text())
    result["out"] = str(out)
    return result


def _max_diff(a, b) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))


def _weights_diff(a: dict, b: dict) -> float:
    assert a["weights"].keys() == b["weights"].keys() and a["weights"]
    return max((torch.tensor(a["weights"][k]) - torch.tensor(b["weights"][k])).abs().max().item()
               for k in a["weights"])


# --- training matches DDP ------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_ddp_after_k_steps(trained, stage, ga):
    ddp, zero = trained[f"ddp_ga{ga}"], trained[f"zero{stage}_ga{ga}"]
    assert len(zero["losses"]) == 8
    assert _max_diff(zero["losses"], ddp["losses"]) <= TOL
    # clip_grad_norm_ returns the norm DeepSpeed measured before clipping, as torch's does
    assert len(zero["norms"]) == 8 // ga
    assert _max_diff(zero["norms"], ddp["norms"]) <= TOL
    assert max(ddp["norms"]) > 0.5  # clipping at 0.5 was active
    assert _max_diff(zero["lrs"], ddp["lrs"]) <= TOL  # the user's LambdaLR, stepped as under DDP
    assert _weights_diff(zero, ddp) <= TOL
    assert zero["engine_optimizer"] == {0: "AdamW", 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer",
                                        3: "DeepSpeedZeroOptimizer_Stage3"}[stage]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gradient_accumulation_changes_the_run(trained):
    # guards the comparison above: GA 2 really takes fewer, larger steps
    assert _max_diff(trained["ddp_ga1"]["losses"], trained["ddp_ga2"]["losses"]) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero2_optimizer_offload_matches_ddp(trained):
    zero, ddp = trained["zero2_offload_ga2"], trained["ddp_ga2"]
    assert zero["config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert zero["base_optimizer"] == "AdamW"  # the user's own optimizer, offloaded as is
    assert _max_diff(zero["losses"], ddp["losses"]) <= TOL
    assert _weights_diff(zero, ddp) <= TOL


# --- configuration -------------------------------------------------------------------------


def _normalized(cfg: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    for key in ("bf16", "fp16"):  # "enabled": false and absent mean the same to DeepSpeed
        if cfg.get(key) == {"enabled": False}:
            del cfg[key]
    return cfg


@pytest.mark.multiprocess
@pytest.mark.slow
def test_json_with_auto_values_equals_the_same_settings_in_torchbay_config(trained):
    from_json, from_section = trained["json_auto_ga2"], trained["section_ga2"]
    assert from_json["losses"] == from_section["losses"]
    assert from_json["weights"] == from_section["weights"]
    assert _normalized(from_json["config"]) == _normalized(from_section["config"])
    assert from_json["config"]["train_micro_batch_size_per_gpu"] == 4  # the loader's batch size
    assert from_json["config"]["train_batch_size"] == 16  # 4 x GA 2 x 2 processes
    assert from_json["config"]["gradient_clipping"] == 0.5  # from deepspeed.gradient_clipping
    report = "\n".join(from_json["report"])
    assert "train_micro_batch_size_per_gpu: auto -> 4" in report and "train_batch_size: auto -> 16" in report


@pytest.mark.multiprocess
@pytest.mark.slow
def test_deepspeed_optimizer_and_scheduler_from_json(trained):
    run = trained["json_optimizer"]
    assert run["base_optimizer"] == "AdamW"
    params = run["config"]["optimizer"]["params"]
    assert params["lr"] == 0.01 and params["weight_decay"] == 0.01  # filled from DummyOptim
    assert run["config"]["scheduler"]["params"]["warmup_num_steps"] == 3  # from DummyScheduler
    lrs = run["lrs"]
    assert lrs[0] < lrs[1] < lrs[2] == pytest.approx(0.01)  # DeepSpeed's WarmupLR, stepped by the engine
    assert run["losses"][-1] < run["losses"][0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mixed_precision_bf16_becomes_deepspeeds_bf16(trained):
    run, ddp = trained["zero2_bf16"], trained["ddp_ga1"]
    assert run["config"]["bf16"] == {"enabled": True} and "fp16" not in run["config"]
    assert run["param_dtype"] == "torch.bfloat16" and run["precision"] == "deepspeed bf16"
    # bf16 weights: close to the fp32 DDP run, not equal
    assert _max_diff(run["losses"], ddp["losses"][:len(run["losses"])]) < 0.05
    assert run["weights"] and all(isinstance(v, list) for v in run["weights"].values())


def test_values_set_in_both_places_are_rejected_with_both_shown(tmp_path, deepspeed_context):
    from torchbay.errors import IncompatibleSetupError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 4,
                                "gradient_clipping": 1.0, "bf16": {"enabled": True}}))
    with pytest.raises(IncompatibleSetupError) as info:
        deepspeed_context({"gradient_accumulation_steps": 2, "deepspeed.deepspeed_config_file": str(path),
                           "deepspeed.zero_stage": 2, "deepspeed.gradient_clipping": 0.5})
    problems = info.value.problems
    text = "\n".join(problems)
    assert ("'zero_optimization.stage' is 3 in the DeepSpeed JSON" in text
            and "but 2 in torchbay 'deepspeed.zero_stage'" in text)
    assert "'gradient_accumulation_steps' is 4" in text and "but 2 in torchbay 'gradient_accumulation_steps'" in text
    assert "'gradient_clipping' is 1.0" in text and "0.5" in text
    assert "'bf16.enabled' is True" in text and "mixed_precision" in text and "'no'" in text
    assert "Accelerator(...) arguments" in text  # where the torchbay value came from
    assert len([p for p in problems if "DeepSpeed" in p]) == 4  # every conflict at once


def test_deepspeeds_decoupled_checkpoint_writer_is_refused_before_training(tmp_path, deepspeed_context):
    """DeepSpeed's decoupled writer finishes files after save returns: torchbay would publish them unwritten."""
    from torchbay.errors import IncompatibleSetupError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2},
                                "checkpoint": {"writer": {"decoupled": True, "type": "fast"}}}))
    with pytest.raises(IncompatibleSetupError, match="remove \"decoupled\" from the DeepSpeed config"):
        deepspeed_context({"deepspeed.deepspeed_config_file": str(path)})
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "checkpoint": {"writer": {"decoupled": False}}}))
    deepspeed_context({"deepspeed.deepspeed_config_file": str(path)})  # the in-call writer is accepted


def test_auto_and_equal_values_are_no_conflict(tmp_path, deepspeed_context):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto",
                                "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}}))
    context = deepspeed_context({"gradient_accumulation_steps": 2, "mixed_precision": "bf16",
                                 "deepspeed.deepspeed_config_file": str(path), "deepspeed.zero_stage": 2})
    from torchbay_deepspeed.config import base_config

    cfg, origins, problems = base_config(context.resolved, 2)
    assert problems == []
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["bf16"] == {"enabled": True}
    assert "Accelerator(...) arguments" in origins["gradient_accumulation_steps"]


def test_unknown_section_key_suggests_the_right_one(tmp_path, deepspeed_context):
    from torchbay.errors import ConfigError

    with pytest.raises(ConfigError, match=r"did you mean 'deepspeed.zero_stage'"):
        deepspeed_context({"deepspeed.zero_stag": 3})


def test_fill_auto_uses_hidden_size_batch_and_reports_what_it_cannot_fill():
    from torchbay_deepspeed.auto_values import fill_auto

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    cfg = {"gradient_accumulation_steps": 2, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}, "wall_clock_breakdown": "auto"}
    filled, report, problems = fill_auto(cfg, micro_batch=(8, "loader"), world_size=4, model=model,
                                         has_optimizer=True)
    assert filled["train_micro_batch_size_per_gpu"] == 8 and filled["train_batch_size"] == 64
    zero = filled["zero_optimization"]
    assert zero["reduce_bucket_size"] == 128 * 128 and zero["stage3_param_persistence_threshold"] == 1280
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 128 * 128)
    assert any("hidden size 128" in line for line in report)
    assert problems and "wall_clock_breakdown" in problems[0]


def test_cli_flags_feed_the_deepspeed_section():
    from torchbay.registry.manager import PluginManager
    from torchbay.registry.resolve import resolve_config

    pm = PluginManager()
    parser = argparse.ArgumentParser()
    pm.hook.torchbay_add_cli_options.call_historic(kwargs={"parser": parser, "command": "launch"})
    args = vars(parser.parse_args(["--zero-stage", "3", "--offload-param-device", "cpu", "--zero3-init",
                                   "--deepspeed-gradient-clipping", "1.5"]))
    assert args == {"deepspeed.zero_stage": 3, "deepspeed.offload_param_device": "cpu", "deepspeed.zero3_init": True,
                    "deepspeed.gradient_clipping": 1.5}
    assert vars(parser.parse_args([])) == {}  # unset flags do not override other sources
    config = resolve_config(cli=args, pm=pm, environ={}).config
    assert config.deepspeed.zero_stage == 3 and config.deepspeed.zero3_init


def test_launch_env_memory_estimate_and_env_report(tmp_path):
    from torchbay.registry.manager import PluginManager
    from torchbay.registry.resolve import resolve_config

    pm = PluginManager()
    config = resolve_config(args={"strategy": "deepspeed", "device": "cpu", "deepspeed.zero_stage": 3}, pm=pm,
                            environ={}).config
    strategy_cls = pm.registries()["strategies"]["deepspeed"]
    assert strategy_cls.launch_env(2, config, pm.registries()["devices"]["cpu"]) == {"DS_ACCELERATOR": "cpu"}
    est = strategy_cls.estimate_memory(config, 4, {"parameters": 1000, "trainable": 1000})
    assert (est.parameters, est.gradients, est.optimizer, est.note) == (1000, 1000, 2000, "ZeRO-3")
    assert any("deepspeed" in r for r in pm.hook.torchbay_report_env() if r)


def test_importing_the_plugin_does_not_import_deepspeed(tmp_path):
    code = textwrap.dedent("""
        import sys
        import torchbay_deepspeed, torchbay_deepspeed.plugin
        from torchbay.registry.resolve import resolve_config
        from torchbay.registry.manager import PluginManager
        from torchbay.registry.selection import build_context
        pm = PluginManager()
        assert "deepspeed" in pm.registries()["strategies"]
        resolved = resolve_config(args={"strategy": "deepspeed", "deepspeed.zero_stage": 3}, pm=pm, environ={})
        build_context(resolved, pm)  # selection and validation too
        print(sorted(m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- several models, ZeRO-3 weights and resume ---------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_student_teacher_train_and_checkpoint_both(state):
    assert state["engines"] == 2 and state["trains"] == [True, False]
    assert state["student_moved"] > 1e-3 and state["teacher_moved"] == 0.0  # the student learns, the teacher is frozen
    files = state["files"]
    assert "deepspeed_model_0" in files  # the student: DeepSpeed's own checkpoint, every rank's part
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(
        state["ds_files"])
    assert "model_1.safetensors" in files  # the frozen teacher: its full weights
    # save_state(blocking=False): synchronous (published in the call), one warning naming the engine and why
    assert state["async_done_at_return"] and len(state["async_warnings"]) == 1
    assert all(words in state["async_warnings"][0] for words in (
        "(this run: TorchCheckpointEngine)", "DecoupledCheckpointEngine", "use strategy fsdp"))
    assert state["teacher_differs_before_load"] > 0.1 and state["teacher_after_load"] == 0.0
    # each engine's "auto" values came from its own model
    assert any("hidden size 32" in line for line in state["report"][0])
    assert any("hidden size 16" in line for line in state["report"][1])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero3_save_model_equals_gathered_parameters(state):
    assert state["raw_state_numel"] < state["param_numel"]  # the module's own state_dict is partitioned
    assert state["saved_numel"] == state["param_numel"] == 1540
    assert state["empty_saved"] == []
    assert state["saved_vs_gathered"] == 0.0
    assert state["state_dict_vs_gathered"] == 0.0  # get_state_dict too


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero3_resume_is_identical_to_the_uninterrupted_run(state):
    assert state["student_after_load"] == 0.0
    assert state["batches_match"]
    assert state["resumed_losses"] == state["losses"][4:]
    assert state["final_vs_uninterrupted"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_changed_world_size_is_a_clear_error_then_loads_as_universal_checkpoint(state):
    """The 2-process ZeRO-3 checkpoint, loaded by one process (no torchrun)."""
    from torchbay.testing.processes import run_python

    out = state["out"]
    run_python(os.path.join(SCRIPTS, "deepspeed_state.py"), ["--out", out, "--stage", "3", "--resume-elsewhere"],
               timeout=240).check()
    result = json.loads(open(os.path.join(out, "result_universal_zero3.json")).read())
    assert result["world_size"] == 1
    error = result["plain_error"]
    assert "written by 2 processes and this run has 1" in error
    assert "deepspeed.load_universal: true" in error and "ds_to_universal" in error
    # converted in a temporary directory beside the checkpoint, removed afterwards: the checkpoint is unchanged
    assert "ds" in result["engine_dir_after_load"] and "universal" not in result["engine_dir_after_load"]
    assert not [n for n in result["beside_checkpoint"] if "universal" in n]
    assert result["student_vs_saved"] == 0.0  # every full weight back, now in one partition
    assert all(loss == loss and loss < 10 for loss in result["losses"])  # and training goes on


# --- Accelerate's DeepSpeed objects (HfDeepSpeedConfig, DeepSpeedPlugin) without transformers -------------------


def test_hf_deepspeed_config_reads_a_file_a_dict_json_text_and_base64(tmp_path):
    import base64

    from torchbay_deepspeed.compat import HfDeepSpeedConfig

    from torchbay.errors import ConfigError

    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "train_batch_size": "auto"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    text = json.dumps(cfg)
    for source in (cfg, str(path), path, text, base64.urlsafe_b64encode(text.encode()).decode()):
        assert HfDeepSpeedConfig(source).config == cfg
    from_dict = HfDeepSpeedConfig(cfg)
    from_dict.config["train_batch_size"] = 8
    assert cfg["train_batch_size"] == "auto"  # the caller's dict is copied, its "auto" values stay
    with pytest.raises(ConfigError, match="neither an existing DeepSpeed JSON file"):
        HfDeepSpeedConfig(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        HfDeepSpeedConfig("[1, 2]")


def test_hf_deepspeed_config_queries_as_accelerate():
    from torchbay_deepspeed.compat import HfDeepSpeedConfig

    from torchbay.errors import ConfigError

    hf = HfDeepSpeedConfig({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                            "bf16": {"enabled": False}, "fp16": {"enabled": True}})
    assert hf.get_value("zero_optimization.stage") == 3 and hf.get_value("zero_optimization.nope", 7) == 7
    assert hf.get_value("optimizer.params.lr") is None  # a missing parent section is no error
    assert hf.find_config_node("optimizer.params.lr") == (None, "lr")
    node, key = hf.find_config_node("zero_optimization.offload_param.device")
    assert node is hf.config["zero_optimization"]["offload_param"] and key == "device"
    assert hf.is_zero3() and not hf.is_zero2() and hf.is_offload()
    assert hf.is_true("fp16.enabled") and hf.is_false("bf16.enabled")
    assert not hf.is_true("amp.enabled") and not hf.is_false("amp.enabled")  # unset is neither
    hf.del_config_sub_tree("zero_optimization.offload_param")
    hf.del_config_sub_tree("scheduler")  # missing: nothing to do
    with pytest.raises(ConfigError, match="no 'scheduler' to delete"):
        hf.del_config_sub_tree("scheduler", must_exist=True)
    hf.set_stage_and_offload()
    assert not hf.is_offload()
    # offload counts under ZeRO 2/3 only; no stage is -1
    assert not HfDeepSpeedConfig({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
                                 ).is_offload()
    assert HfDeepSpeedConfig({})._stage == -1


def test_deepspeed_plugin_fields_fill_auto_and_the_config_wins():
    from torchbay_deepspeed.compat import DeepSpeedPlugin, HfDeepSpeedConfig

    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": "auto"}, "gradient_clipping": 0.3},
                             zero_stage=3, gradient_clipping=1.0, offload_optimizer_device="cpu")
    assert plugin.deepspeed_config is plugin.hf_ds_config.config
    assert plugin.deepspeed_config["zero_optimization"] == {"stage": 3}  # "auto" filled from the field
    assert plugin.gradient_clipping == 0.3  # a value set in the config wins over the field
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1  # Accelerate's default when absent
    assert plugin.zero_stage == 3 and plugin.hf_ds_config.is_zero3() and plugin.zero3_init_flag
    assert plugin.is_auto("train_batch_size") is False and plugin.get_value("zero_optimization.stage") == 3

    class TrainerConfig(HfDeepSpeedConfig):  # what transformers passes: its subclass, kept as the same object
        pass

    hf = TrainerConfig({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"})
    plugin = DeepSpeedPlugin(hf_ds_config=hf)
    assert plugin.hf_ds_config is hf and plugin.deepspeed_config is hf.config
    assert plugin.zero_stage == 2 and not plugin.zero3_init_flag and plugin.is_auto("train_micro_batch_size_per_gpu")
    assert plugin.to_config() == {"strategy": "deepspeed", "gradient_accumulation_steps": 1, "deepspeed.config": {
        "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1}}


def test_deepspeed_plugin_without_a_config_makes_accelerates_and_refuses_what_torchbay_lacks():
    from torchbay_deepspeed.compat import DeepSpeedPlugin

    from torchbay.errors import ConfigError

    plugin = DeepSpeedPlugin(zero_stage=1, gradient_clipping=0.5)
    cfg = plugin.deepspeed_config
    assert cfg["zero_optimization"]["stage"] == 1 and cfg["gradient_clipping"] == 0.5
    assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["gradient_accumulation_steps"] == "auto"
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "none", "nvme_path": None}
    assert plugin.offload_param_device == "none" and plugin.zero3_init_flag is False
    assert "gradient_accumulation_steps" not in plugin.to_config()  # "auto": the Accelerator's value
    assert DeepSpeedPlugin().deepspeed_config["gradient_clipping"] == "auto"  # filled at prepare, as Accelerate
    with pytest.raises(ConfigError, match="no 'zero_optimization' section"):
        DeepSpeedPlugin(hf_ds_config={"train_batch_size": 8})
    with pytest.raises(ConfigError, match="enable_msamp"):
        DeepSpeedPlugin(enable_msamp=True)
    with pytest.raises(ConfigError, match="selected by passing it to Accelerator"):
        plugin.select()
    with pytest.raises(ConfigError):
        plugin.selected = True


def test_deepspeed_plugin_fill_match_and_config_process_as_accelerate():
    from torchbay_deepspeed.compat import DeepSpeedPlugin

    from torchbay.errors import ConfigError

    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                                           "train_batch_size": 16, "optimizer": {"params": {"lr": "auto"}}})
    mismatches: list = []
    plugin.fill_match("train_batch_size", mismatches, train_batch_size=8)
    assert mismatches == ["- ds train_batch_size=16 vs arg train_batch_size=8"]
    plugin.fill_match("train_batch_size", must_match=False, train_batch_size=8)  # no check asked
    plugin.fill_match("scheduler.params.total_num_steps", total=3)  # no such section: nothing
    with pytest.raises(ConfigError, match="'optimizer.params.lr' is \"auto\" and nothing fills it"):
        plugin.fill_match("optimizer.params.lr")
    with pytest.raises(ConfigError) as info:
        plugin.deepspeed_config_process(**{"zero_optimization.reduce_bucket_size": 64, "optimizer.params.lr": 0.1,
                                           "train_batch_size": 4})
    assert "- ds train_batch_size=16 vs arg train_batch_size=4" in info.value.problems
    assert plugin.get_value("zero_optimization.reduce_bucket_size") == 64
    assert plugin.get_value("optimizer.params.lr") == 0.1
    plugin.deepspeed_config_process(must_match=False, train_batch_size=4)
    assert plugin.get_value("train_batch_size") == 16


def test_deepspeed_plugin_set_mixed_precision():
    from torchbay_deepspeed.compat import DeepSpeedPlugin

    from torchbay.errors import ConfigError

    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}})
    plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"] == {"enabled": True}
    assert plugin.deepspeed_config["fp16"] == {"enabled": False}
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}})
    plugin.set_mixed_precision("fp16")
    assert plugin.deepspeed_config["fp16"] == {"enabled": True, "auto_cast": True}
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="mixed_precision is bf16 but the DeepSpeed config enables fp16"):
        plugin.set_mixed_precision("bf16")


def test_accelerate_names_come_from_the_plugin():
    from torchbay_deepspeed import compat

    from torchbay import utils

    for name in ("HfDeepSpeedConfig", "DeepSpeedPlugin", "DeepSpeedSchedulerWrapper", "DummyOptim", "DummyScheduler"):
        assert getattr(utils, name) is getattr(compat, name)
    from torchbay.accelerator.prepared import AcceleratedScheduler

    assert issubclass(compat.DeepSpeedSchedulerWrapper, AcceleratedScheduler)  # as Accelerate's


@pytest.mark.slow
def test_deepspeed_plugin_through_the_accelerator_as_transformers_trainer_uses_it(tmp_path):
    """One process (torchrun), real DeepSpeed: plugins/deepspeed/tests/scripts/deepspeed_plugin_compat.py. Run on
    Accelerate 1.15 with the same script, the losses, learning rates and the filled config are the same (checked by
    hand, and by tests/compat_hf through transformers' Trainer)."""
    run_torchrun(os.path.join(SCRIPTS, "deepspeed_plugin_compat.py"), 1, ["--out", str(tmp_path)],
                 env={"TORCHBAY_AS_ACCELERATE": "1"}, timeout=240).check()
    result = json.loads((tmp_path / "result_plugin.json").read_text())
    assert result["served_by"] == "torchbay" and result["user_config_untouched"]
    assert result["state_plugin_is_the_users"] and result["selected"] and result["distributed_type"] == "DEEPSPEED"
    assert result["engine"] == "DeepSpeedEngine" and result["scheduler_is_wrapper"]
    assert result["scheduler"] == "WarmupDecayLR"
    filled = result["filled"]  # Accelerate's fills, written into the plugin's config in place
    assert filled["optimizer"]["params"] == {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}  # DummyOptim
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                             "total_num_steps": 7}  # 7: written after the Accelerator existed
    assert filled["gradient_clipping"] == 1.0 and filled["zero_optimization"]["reduce_bucket_size"] == 64
    assert filled["train_micro_batch_size_per_gpu"] == 4 and filled["train_batch_size"] == 8
    assert filled["gradient_accumulation_steps"] == 2 == result["engine_ga"]  # DeepSpeed's value wins (Accelerate)
    assert result["global_steps"] == 4 and len(result["losses"]) == 8
    assert result["lrs"][:4] == [0, 0.0, 0.0, 0.01]  # the engine steps DeepSpeed's scheduler per window
    assert result["loaded"] and result["restored_diff"] == 0.0  # engine.load_checkpoint, as Trainer calls it
    assert result["checkpoint_loader"].startswith("install_safe_loader")
    error = result["planted_error"]
    assert error.startswith("CheckpointError") and "posix.system" in error and "allow_unsafe_pickle" in error


@pytest.mark.slow
def test_state_deepspeed_plugin_of_a_run_configured_in_torchbay(tmp_path):
    """No DeepSpeedPlugin given: accelerator.state.deepspeed_plugin is made from torchbay's config (a JSON file in
    deepspeed.deepspeed_config_file, "auto" values still open); transformers gives it a new config object and fills
    it, and prepare builds the engine from that one
    (plugins/deepspeed/tests/scripts/deepspeed_plugin_compat.py --from-torchbay-config)."""
    run_torchrun(os.path.join(SCRIPTS, "deepspeed_plugin_compat.py"), 1,
                 ["--out", str(tmp_path), "--from-torchbay-config"], env={"TORCHBAY_AS_ACCELERATE": "1"},
                 timeout=240).check()
    result = json.loads((tmp_path / "result_from_config.json").read_text())
    assert result["plugin"] == "DeepSpeedPlugin" and result["stage"] == 2
    before = result["config_before"]
    assert before["optimizer"]["params"]["lr"] == "auto" and before["gradient_clipping"] == "auto"
    assert before["gradient_accumulation_steps"] == 1  # torchbay's value, already in
    assert result["engine_clip"] == 0.7 and result["warmup_max_lr"] == 0.02  # from the new config object


def test_a_deepspeed_plugins_config_stands_where_the_json_stands(tmp_path):
    from torchbay_deepspeed.config import PLUGIN_SOURCE, base_config

    from torchbay.registry.manager import PluginManager
    from torchbay.registry.resolve import resolve_config

    pm = PluginManager()

    def resolved(**args):
        return resolve_config(args={"strategy": "deepspeed", "device": "cpu", **args}, pm=pm, environ={})

    plugin_cfg = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4, "train_batch_size": "auto"}
    cfg, origins, problems = base_config(resolved(gradient_accumulation_steps=1), 2, plugin_cfg)
    assert not problems and cfg["gradient_accumulation_steps"] == 4  # DeepSpeed's value wins, as in Accelerate
    assert origins["zero_optimization.stage"] == PLUGIN_SOURCE
    _, _, problems = base_config(resolved(**{"deepspeed.zero_stage": 3}), 2, plugin_cfg)
    assert len(problems) == 1 and "is 2 in " + PLUGIN_SOURCE in problems[0] and "deepspeed.zero_stage" in problems[0]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with_file = resolved(**{"deepspeed.deepspeed_config_file": str(path)})
    _, _, problems = base_config(with_file, 2, plugin_cfg)
    assert "both give the DeepSpeed config" in problems[0]
    # the plugin accelerator.state made from torchbay's own config already holds the file's values
    assert base_config(with_file, 2, plugin_cfg, from_user_plugin=False)[2] == []
