"""torchbay-fsdp: FSDP2 on real 2-process gloo groups (CPU) against DDP, sharded checkpoints
that reload into 2 and into 1 process, merge-weights, config, CLI flags and validation.

Three process launches in all (plugins/fsdp/tests/scripts/fsdp_train.py once with 2 processes, then
fsdp_resume.py with 2 and with 1); the other tests run in this process and start nothing.

Tolerances: FSDP2 and DDP both sum the two ranks' fp32 gradients and divide by 2, so on
this machine losses and weights agree to 1e-6 (absolute; observed: bitwise equal). Loading
the 2-process checkpoint into 1 process changes the reduction order (one 8-row mean
instead of two 4-row means), so that run is compared at 1e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from torchbay.testing.processes import run_torchrun

TIGHT = 1e-6
LOOSE = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-process launch: DDP and FSDP2 runs side by side, and a save_state after step S."""
    import os

    out = tmp_path_factory.mktemp("fsdp")
    script = os.path.join(os.path.dirname(__file__), "scripts", "fsdp_train.py")
    run_torchrun(script, 2, ["--out", str(out)], timeout=240).check()
    return out, json.loads((out / "result_train.json").read_text())


def _close(a, b, atol):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


# --- training matches DDP ------------------------------------------------------------------


@pytest.mark.multiprocess
def test_fsdp2_loss_and_weights_match_ddp_after_k_steps(trained):
    _, result = trained
    plain = result["fsdp_plain"]
    assert len(plain["fsdp_losses"]) == 6
    _close(plain["fsdp_losses"], plain["ddp_losses"], TIGHT)
    assert plain["weights_max_diff"] <= TIGHT


@pytest.mark.multiprocess
def test_each_rank_holds_half_of_every_wrapped_parameter(trained):
    _, result = trained
    assert result["wrapped_blocks"] == 3  # transformer_layer_cls_to_wrap: [Block]
    shards = result["shards"]
    assert len(shards) == result["num_params"] == 22  # every parameter is a sharded DTensor
    for name, (local, full) in shards.items():
        assert local in (full // 2, -(-full // 2)), (name, local, full)
    assert sum(local for local, _ in shards.values()) * 2 == sum(full for _, full in shards.values())


@pytest.mark.multiprocess
def test_optimizer_built_before_sharding_is_remapped_and_unwrap_gives_the_module(trained):
    _, result = trained
    assert result["optimizer_remapped"]  # prepare(model) then prepare(opt), opt created before both
    assert result["unwrap_is_model"]


@pytest.mark.multiprocess
def test_gradient_accumulation_and_clipping_match_ddp(trained):
    _, result = trained
    accum = result["fsdp_accum"]
    _close(accum["fsdp_losses"], accum["ddp_losses"], TIGHT)
    _close(accum["fsdp_norms"], accum["ddp_norms"], TIGHT)
    assert max(accum["ddp_norms"]) > 0.05  # the clip (max_norm 0.05) really cut the gradients
    assert accum["weights_max_diff"] <= TIGHT
    # no reduce-scatter inside the window: no sharded gradient exists before the sync micro-batch
    assert accum["no_sharded_grad_before_sync"] == [True] * 4


@pytest.mark.multiprocess
def test_save_model_writes_full_weights_equal_to_ddp(trained):
    from safetensors.torch import load_file

    out, _ = trained
    fsdp = load_file(str(out / "fsdp_model" / "model.safetensors"))
    ddp = load_file(str(out / "ddp_model" / "model.safetensors"))
    assert fsdp.keys() == ddp.keys()
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], atol=TIGHT, rtol=0, msg=key)
    sys.path.insert(0, str(_scripts()))
    try:
        from fsdp_common import Net
    finally:
        sys.path.pop(0)
    Net().load_state_dict(fsdp)  # loads into the plain, unwrapped model


@pytest.mark.multiprocess
def test_cpu_ram_efficient_loading_from_rank0_with_meta_model_elsewhere(trained):
    _, result = trained
    meta = result["meta_loading"]
    assert meta["weights_max_diff"] == 0.0
    assert meta["output_max_diff"] <= TIGHT
    assert meta["buffer"] == [0.5] * 4  # a non-persistent buffer reaches the meta-built rank too


@pytest.mark.multiprocess
def test_bf16_becomes_the_fsdp_mixed_precision_policy_and_fp16_uses_a_sharded_scaler(trained):
    _, result = trained
    bf16 = result["bf16"]
    assert bf16["fsdp"]["compute_dtype"] == "torch.bfloat16"  # gathered in bf16 (MixedPrecisionPolicy)
    assert bf16["fsdp"]["stored_dtype"] == "torch.float32"  # sharded master weights stay fp32
    assert bf16["ddp"]["compute_dtype"] == "torch.float32"  # DDP: autocast casts inside each op
    # bf16 rounds differently in the two (casts before vs inside ops): compare at bf16 precision
    _close(bf16["fsdp"]["losses"], bf16["ddp"]["losses"], 2e-2)
    fp16 = result["fp16"]
    assert fp16["scaler"] == "ShardedGradScaler"  # ranks agree on inf/nan, so they skip the same steps
    assert all(torch.isfinite(torch.tensor(fp16["losses"])))


# --- sharded checkpoints ---------------------------------------------------------------------


@pytest.mark.multiprocess
def test_save_state_writes_shards_from_every_rank(trained):
    out, _ = trained
    ckpt = out / "ckpt"
    manifest = json.loads((ckpt / "torchbay_manifest.json").read_text())
    for stem in ("fsdp_model_0", "fsdp_optimizer_0"):
        assert (ckpt / stem / ".metadata").exists()
        for rank in (0, 1):  # each rank wrote its own file: nothing was gathered to rank 0
            assert any(f.startswith(f"{stem}/__{rank}_") for f in manifest["files"]), (stem, rank)
    assert not (ckpt / "model_0.safetensors").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 1])
def test_load_state_into_2_and_1_processes_continues_like_uninterrupted_run(trained, world):
    """The resuming run prepares its optimizer before its model (separate calls, reverse order)."""
    out, result = trained
    run_torchrun(str(_scripts() / "fsdp_resume.py"), world, ["--out", str(out)], timeout=180).check()
    resumed = json.loads((out / f"result_resume_{world}.json").read_text())
    atol = TIGHT if world == 2 else LOOSE
    _close(resumed["losses"], result["uninterrupted_losses"], atol)
    assert resumed["weights_max_diff"] <= atol
    assert resumed["local_numel"] * world == resumed["numel"]
    assert resumed["from_ddp_max_diff"] == 0.0  # a ddp checkpoint's full weights load into the shards


@pytest.mark.multiprocess
def test_merge_fsdp_weights_removes_only_a_checkpoint_torchbay_wrote(trained, tmp_path):
    import shutil

    from torchbay_fsdp.compat import merge_fsdp_weights

    from torchbay.errors import CheckpointError

    out, _ = trained
    mine = tmp_path / "mine"
    shutil.copytree(out / "ckpt", mine)
    (mine / "notes.txt").write_text("the user's own file")
    with pytest.raises(CheckpointError, match="did not write"):
        merge_fsdp_weights(str(mine), str(tmp_path / "merged_a"), remove_checkpoint_dir=True)
    assert (mine / "notes.txt").read_text() == "the user's own file"
    (mine / "notes.txt").unlink()
    merge_fsdp_weights(str(mine), str(tmp_path / "merged_b"), remove_checkpoint_dir=True)
    assert not mine.exists() and (tmp_path / "merged_b" / "model.safetensors").is_file()


@pytest.mark.multiprocess
def test_merge_weights_command_turns_shards_into_one_safetensors_model(trained, tmp_path):
    from safetensors.torch import load_file

    out, _ = trained
    proc = subprocess.run([sys.executable, "-m", "torchbay.cli.main", "merge-weights", str(out / "ckpt"),
                           str(tmp_path / "merged")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    expected = torch.load(str(out / "ckpt_weights.pt"), weights_only=True)  # full weights at the save
    assert merged.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(merged[key], expected[key], atol=0, rtol=0, msg=key)


def test_merge_weights_names_what_is_missing(tmp_path):
    from torchbay_fsdp.merge import merge_weights

    from torchbay.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no sharded fsdp model 0"):
        merge_weights(tmp_path, tmp_path / "out")


# --- packaging, config, CLI, validation (no process group) --------------------------------


def test_plugin_imports_and_registers_without_importing_fsdp():
    code = textwrap.dedent("""
        import sys
        import torchbay_fsdp.plugin
        from torchbay.registry.manager import PluginManager
        from torchbay.registry.resolve import config_model
        pm = PluginManager()
        assert pm.infos["fsdp"].status == "loaded", pm.infos["fsdp"]
        assert "fsdp" in pm.registries()["strategies"]
        assert "fsdp" in config_model(pm).model_fields
        loaded = [m for m in sys.modules if m.startswith(("torch.distributed.fsdp", "torch.distributed.checkpoint"))]
        assert not loaded, loaded
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_distribution_metadata_declares_the_entry_point_and_only_torchbay_and_torch():
    import importlib.metadata as md

    dist = md.distribution("torchbay-fsdp")
    eps = [ep for ep in dist.entry_points if ep.group == "torchbay"]
    assert [(ep.name, ep.value) for ep in eps] == [("fsdp", "torchbay_fsdp.plugin")]
    from packaging.requirements import Requirement

    assert sorted(Requirement(r).name for r in dist.requires) == ["torch", "torchbay"]


def test_config_section_defaults_sources_and_did_you_mean():
    from torchbay.errors import ConfigError
    from torchbay.registry.resolve import resolve_config

    resolved = resolve_config(environ={"TORCHBAY_FSDP__RESHARD_AFTER_FORWARD": "false"},
                              args={"strategy": "fsdp", "fsdp.transformer_layer_cls_to_wrap": ["Block"]})
    fsdp = resolved.config.fsdp
    assert fsdp.version == 2 and fsdp.reshard_after_forward is False and fsdp.backward_prefetch is None
    assert fsdp.transformer_layer_cls_to_wrap == ["Block"]
    assert resolved.source_of("fsdp.reshard_after_forward") == "env"
    with pytest.raises(ConfigError, match="did you mean 'fsdp.backward_prefetch'"):
        resolve_config(environ={}, args={"fsdp.backward_prefech": "BACKWARD_PRE"})
    with pytest.raises(ConfigError, match="fsdp.version"):
        resolve_config(environ={}, args={"fsdp.version": 3})


def _context(**args):
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config
    from torchbay.registry.selection import build_context

    pm = get_plugin_manager()
    return build_context(resolve_config(environ={}, args={"strategy": "fsdp", "device": "cpu", **args}, pm=pm), pm)


def test_validation_lists_every_bad_combination_with_its_fix():
    from torchbay.errors import IncompatibleSetupError

    assert _context().strategy_cls.name == "fsdp"
    with pytest.raises(IncompatibleSetupError) as info:
        _context(**{"fsdp.version": 1, "fsdp.cpu_offload": True, "fsdp.wrap_policy": "none",
                    "fsdp.activation_checkpointing": True, "fsdp.transformer_layer_cls_to_wrap": ["Block"]})
    problems = info.value.problems
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "needs an accelerator" in text and "use fsdp.version: 2" in text
    assert "set fsdp.cpu_offload: false" in text
    assert "set fsdp.wrap_policy: transformer" in text
    with pytest.raises(IncompatibleSetupError, match="exists only in FSDP1"):
        _context(**{"fsdp.backward_prefetch": "BACKWARD_POST"})
    with pytest.raises(IncompatibleSetupError, match="disagrees with mixed_precision"):
        _context(**{"mixed_precision": "bf16", "fsdp.param_dtype": "float16"})


def test_cli_flags_feed_the_fsdp_section_only_for_launch_and_test():
    import argparse

    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    parsers = {}
    for command in ("launch", "test", "config"):
        parsers[command] = argparse.ArgumentParser()
        pm.hook.torchbay_add_cli_options.call_historic(kwargs={"parser": parsers[command], "command": command})
    assert "--fsdp-version" not in parsers["config"].format_help()
    args = vars(parsers["launch"].parse_args(["--fsdp-version", "2", "--no-fsdp-reshard-after-forward",
                                              "--fsdp-transformer-layer-cls-to-wrap", "Block,Head"]))
    assert args == {"fsdp.version": 2, "fsdp.reshard_after_forward": False,
                    "fsdp.transformer_layer_cls_to_wrap": ["Block", "Head"]}  # unset flags stay unset
    resolved = resolve_config(environ={}, cli=args, pm=pm)
    assert resolved.config.fsdp.transformer_layer_cls_to_wrap == ["Block", "Head"]
    assert resolved.source_of("fsdp.version") == "cli"
    assert vars(parsers["test"].parse_args([])) == {}


def test_merge_weights_is_a_torchbay_subcommand():
    from torchbay.cli.main import build_parser

    args = build_parser().parse_args(["merge-weights", "ckpt", "out"])
    assert args.checkpoint_dir == "ckpt" and args.output_dir == "out" and args.model_index == 0


def test_memory_estimate_divides_parameters_gradients_and_optimizer_by_world():
    from torchbay.registry.manager import get_plugin_manager
    from torchbay.registry.resolve import resolve_config

    pm = get_plugin_manager()
    config = resolve_config(environ={}, args={"strategy": "fsdp"}, pm=pm).config
    estimate = pm.registries()["strategies"]["fsdp"].estimate_memory(config, 4, {"parameters": 1000, "trainable": 1000})
    assert ((estimate.parameters, estimate.gradients, estimate.optimizer, estimate.sharding_factor)
            == (1000, 1000, 2000, 4))


def _strategy(**fsdp):
    context = _context(**{f"fsdp.{k}": v for k, v in fsdp.items()})
    return context.strategy_cls(context)  # no process group: only the wrap policy is exercised


def test_wrap_policies_choose_blocks_by_class_name_no_split_modules_or_size():
    from torch import nn

    from torchbay.errors import TorchbayError

    sys.path.insert(0, str(_scripts()))
    try:
        from fsdp_common import Net
    finally:
        sys.path.pop(0)
    model = Net()
    names = lambda mods: [type(m).__name__ for m in mods]  # noqa: E731
    assert names(_strategy(transformer_layer_cls_to_wrap=["Block"])._blocks(model)) == ["Block"] * 3
    assert _strategy()._blocks(model) == []  # no class names and no _no_split_modules: root only
    model._no_split_modules = ["Block"]  # the Hugging Face convention is the fallback
    assert names(_strategy()._blocks(model)) == ["Block"] * 3
    with pytest.raises(TorchbayError, match="'Blok'.*not found in Net"):
        _strategy(transformer_layer_cls_to_wrap=["Blok"])._blocks(model)
    # size, bottom-up: a Block holds 1,104 parameters, its Linears 544 and 528 (the rest of the model 212)
    assert names(_strategy(wrap_policy="size", min_num_params=1000)._blocks(model)) == ["Block"] * 3
    small = _strategy(wrap_policy="size", min_num_params=500)._blocks(model)
    assert small == [m for b in model.blocks for m in (b.up, b.down)]  # then each Block's rest (32) is too small
    assert _strategy(wrap_policy="none")._blocks(model) == []
    assert isinstance(model.blocks, nn.ModuleList)


def test_env_report_names_the_fsdp_plugin():
    from torchbay.registry.manager import get_plugin_manager

    reports = [r for r in get_plugin_manager().hook.torchbay_report_env() if r and "fsdp" in r]
    assert reports and "FSDP2" in reports[0]["fsdp"] and torch.__version__ in reports[0]["fsdp"]


def _accelerator_for_fsdp1() -> tuple[str | None, str]:
    """The torch type of an accelerator that a torchbay device plugin serves here, or why none."""
    if not torch.accelerator.is_available():
        return None, ("FSDP1 (fsdp.version: 1) needs an accelerator (cuda, xpu, npu or hpu); torch finds none on "
                      "this machine (cpu only)")
    kind = torch.accelerator.current_accelerator().type
    from torchbay.registry.manager import get_plugin_manager

    devices = get_plugin_manager().registries()["devices"]
    name = next((n for n, cls in devices.items() if cls.torch_type() == kind and cls.is_available()), None)
    if name is None:
        return None, f"FSDP1 needs the torchbay device plugin for '{kind}' (pip install torchbay-{kind})"
    return name, ""


@pytest.mark.multiprocess
def test_fsdp1_on_an_accelerator_matches_single_and_round_trips_a_checkpoint(tmp_path):
    device, reason = _accelerator_for_fsdp1()
    if device is None:
        pytest.skip(reason)
    run_torchrun(str(_scripts() / "fsdp_v1.py"), 1, ["--out", str(tmp_path)], env={"FSDP_TEST_DEVICE": device},
                 timeout=300).check()
    result = json.loads((tmp_path / "result_v1.json").read_text())
    _close(result["losses"], result["ref_losses"], 1e-4)
    assert result["weights_max_diff"] <= 1e-4


def _scripts():
    from pathlib import Path

    return Path(__file__).parent / "scripts"
