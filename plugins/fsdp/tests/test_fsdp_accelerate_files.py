"""Accelerate's FSDP checkpoint functions as torchbay-fsdp serves them (issue 25: transformers' Trainer calls
them): real FSDP2 on CPU, 2 gloo processes, no transformers. Each state_dict_type is saved, loaded into a model
with other initial weights and trained on: the losses equal the uninterrupted run's. The real Accelerate's own
functions read what torchbay wrote and torchbay reads what they wrote (same file names and contents)."""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest

from torchbay.testing.processes import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_accelerate_files.py"
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
NAMES = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")


@pytest.fixture(scope="module", params=["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def result(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param.lower())
    cross = ["--cross"] if HAS_ACCELERATE else []
    run_torchrun(str(SCRIPT), 2, ["--out", str(out), "--type", request.param, *cross], timeout=300).check()
    return request.param, json.loads((out / "result.json").read_text())


def test_resuming_from_the_files_continues_exactly_like_the_uninterrupted_run(result):
    kind, r = result
    assert r["resumed"] == r["uninterrupted"]
    assert r["loaded_diff"] == 0.0
    assert r["files"] == (["optimizer.bin", "pytorch_model_fsdp.bin"] if kind == "FULL_STATE_DICT"
                          else ["optimizer_0", "pytorch_model_fsdp_0"])


def test_state_fsdp_plugin_is_the_users_object_filled_from_the_run(result):
    kind, r = result
    assert r["same_object"] is True and r["fsdp_version"] == 2
    assert r["state_dict_type"] == f"StateDictType.{kind}"


def test_full_state_dict_is_a_plain_state_dict_rank0_wrote(result):
    kind, r = result
    if kind != "FULL_STATE_DICT":
        pytest.skip("full state dict only")
    assert r["full_keys_match"] is True and r["full_diff"] == 0.0


def test_never_overwrites_what_torchbay_did_not_write_and_every_rank_raises(result):
    kind, r = result
    assert "was not written by torchbay" in r["foreign"] or "holds files torchbay did not write" in r["foreign"]
    assert r["again"] == ""  # its own file (its own DCP folder, as its .torchbay_fsdp.json lists it) is replaced
    if kind == "SHARDED_STATE_DICT":
        assert r["mark"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "missing" in r["missing"] or "no .metadata" in r["missing"]


@pytest.mark.skipif(not HAS_ACCELERATE, reason="the real Accelerate is not installed")
def test_accelerate_reads_torchbay_files_and_torchbay_reads_accelerates(result):
    kind, r = result
    assert r["accelerate_reads_torchbay"] == r["uninterrupted"]
    assert r["torchbay_reads_accelerate"] == r["uninterrupted"]
    assert r["overwrite_accelerate_file"]  # refused: Accelerate wrote it
    if kind == "FULL_STATE_DICT":
        assert r["foreign_unchanged"] is True


@pytest.mark.skipif(not HAS_ACCELERATE, reason="the real Accelerate is not installed")
def test_signatures_are_accelerates():
    import torchbay_fsdp.compat as ours
    from accelerate.utils import fsdp_utils

    for name in NAMES:
        assert inspect.signature(getattr(ours, name)) == inspect.signature(getattr(fsdp_utils, name)), name


def test_plugin_accepts_what_trainer_passes_and_refuses_what_would_change_results():
    from torchbay_fsdp.compat import FullyShardedDataParallelPlugin

    from torchbay.errors import ConfigError

    trainer_v2 = dict(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                      transformer_cls_names_to_wrap="LlamaDecoderLayer", cpu_ram_efficient_loading=False,
                      state_dict_type="FULL_STATE_DICT", reshard_after_forward=True)
    config = FullyShardedDataParallelPlugin(**trainer_v2).to_config()
    assert config["fsdp.transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"] and config["fsdp.version"] == 2
    trainer_v1 = dict(fsdp_version=1, reshard_after_forward="full_shard", forward_prefetch=False,
                      backward_prefetch="NO_PREFETCH", use_orig_params=True, sync_module_states=True,
                      limit_all_gathers=True, state_dict_type="SHARDED_STATE_DICT")
    config = FullyShardedDataParallelPlugin(**trainer_v1).to_config()
    assert config["fsdp.cpu_ram_efficient_loading"] is True and config["fsdp.reshard_after_forward"] is True
    for bad, word in ((dict(use_orig_params=False), "use_orig_params"), (dict(forward_prefetch=True), "forward_"),
                      (dict(activation_checkpointing_offload=True), "activation_checkpointing_offload"),
                      (dict(mixed_precision_policy="bf16"), "mixed_precision_policy")):
        with pytest.raises(ConfigError, match=word):
            FullyShardedDataParallelPlugin(**bad).to_config()
    with pytest.raises(ConfigError, match="LOCAL_STATE_DICT does not exist in FSDP2"):
        FullyShardedDataParallelPlugin(state_dict_type="LOCAL_STATE_DICT")
