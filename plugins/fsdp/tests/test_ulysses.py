"""Ulysses sequence parallelism (issue 39): Accelerate's sp_size / sp_backend / DeepSpeedSequenceParallelConfig
spellings, the sequence sharded by the data loader, the attention wrapped through transformers' AttentionInterface,
the loss a token-weighted mean over the sp group, composed with FSDP2 over dp_shard; and each config error.

Two process launches (plugins/fsdp/tests/scripts/ulysses_train.py): 2 processes (sp 2 with the model's sdpa,
sp 2 with eager attention) and 4 (dp_shard 2 x sp 2, dp_replicate 2 x sp 2 (HSDP), sp 2 x tp 2), each against the
unsharded single-process run. Observed on this machine: losses equal to 1e-7, first gradients to 3e-8, weights after
2 AdamW steps to 3.7e-7 (2 SGD steps beside tp: 1.2e-7).

transformers' Trainer and trl's SFTTrainer with ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")`` under the
switch (plugins/fsdp/tests/scripts/ulysses_trainer.py: 1 process unsharded, then 2 processes at sp 2): observed
losses equal to 9.6e-7 over 8 steps, learning rates, steps and epochs equal, Trainer's weights to 8.1e-7 and its
evaluation loss to 4.8e-7.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from torchbay.errors import ConfigError
from torchbay.testing.processes import run_python, run_torchrun

pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ulysses_train.py")
TRAINER_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ulysses_trainer.py")
ATOL = 1e-5


@pytest.fixture(scope="module", params=[2, 4])
def trained(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ulysses{request.param}")
    run_torchrun(SCRIPT, request.param, ["--out", str(out)], timeout=400).check()
    return json.loads((out / f"result_{request.param}.json").read_text())


@pytest.mark.multiprocess
def test_loss_gradients_and_weights_equal_the_unsharded_run(trained):
    for name, got in trained.items():
        steps = torch.tensor(got["losses"])  # [step][rank]
        dp_mean = steps.reshape(len(steps), -1, 2).mean(dim=(1, 2))  # sp ranks hold the same (global) loss
        torch.testing.assert_close(steps[:, 0::2], steps[:, 1::2], atol=0, rtol=0)
        torch.testing.assert_close(dp_mean, torch.tensor(got["reference_losses"]), atol=ATOL, rtol=0)
        assert got["grad_diff"] <= ATOL and got["weight_diff"] <= ATOL, (name, got)
        assert got["attn"] == "torchbay_ulysses" and got["sp_backend"] == "torchbay"
        half = 8 // 2  # each sp rank holds half of the sequence, position ids included; the labels stay whole
        assert {k: shape[1] for k, shape in got["batch_shapes"].items()} == {
            "input_ids": half, "position_ids": half, "labels": 8}, got["batch_shapes"]
    assert list(trained) in (["sp2", "sp2_eager"], ["sp2_dp2", "sp2_rep2", "sp2_tp2"])
    if "sp2_dp2" in trained:
        assert [trained[name]["mesh"] for name in ("sp2_dp2", "sp2_rep2", "sp2_tp2")] == [
            ["dp_shard", "sp"], ["dp_replicate", "sp"], ["sp", "tp"]]


@pytest.mark.multiprocess
def test_trainer_and_sft_trainer_with_accelerates_sp_size_equal_the_unsharded_run(tmp_path):
    """Trainer's num_items_in_batch (it divides its token count by sp_size), its steps per epoch (it multiplies the
    loader's length by sp_size) and so its learning-rate schedule come out as in the unsharded run."""
    pytest.importorskip("trl")
    switch = {"TORCHBAY_AS_ACCELERATE": "1"}
    run_python(TRAINER_SCRIPT, [str(tmp_path), "--sp", "1"], env=switch, timeout=400).check()
    run_torchrun(TRAINER_SCRIPT, 2, [str(tmp_path), "--sp", "2"], env=switch, timeout=400).check()
    reference, got = (json.loads((tmp_path / f"result_sp{n}.json").read_text()) for n in (1, 2))
    for name in ("trainer", "sft"):
        ref, run = reference[name], got[name]
        assert (run["steps"], run["epoch"], run["lrs"]) == (ref["steps"], ref["epoch"], ref["lrs"]), (name, run, ref)
        assert (ref["steps"], ref["epoch"]) == (8, 2.0)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
        assert run["attn"] == "torchbay_ulysses" and ref["attn"] == "sdpa"
    assert abs(got["trainer"]["eval_loss"] - reference["trainer"]["eval_loss"]) <= ATOL  # Trainer.evaluate at sp 2
    weights = [torch.load(tmp_path / f"weights_sp{n}.pt", weights_only=True) for n in (1, 2)]
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) <= ATOL


# --- config time, no process group -------------------------------------------------------------------


def test_accelerates_spellings_are_accepted():
    from torchbay import DeepSpeedSequenceParallelConfig, ParallelismConfig

    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig())
    assert pc.sp_enabled and pc.sp_handler.sp_seq_length_is_variable is True
    assert pc.total_size == 2 and pc.non_dp_dim_names == ["sp"] and pc._get_mesh() == (("sp",), (2,))
    assert ParallelismConfig(sp_size=2).sp_backend == "torchbay"
    assert ParallelismConfig(sp_size=2, sp_backend="torchbay").to_config()["parallelism.sp_size"] == 2


def test_sp_config_errors_name_the_fix(monkeypatch):
    from torchbay import DeepSpeedSequenceParallelConfig, ParallelismConfig

    with pytest.raises(ValueError, match="Invalid sp_attn_implementation"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="foobar")
    with pytest.raises(ConfigError, match="sp_seq_length_is_variable=False.*needs sp_seq_length"):
        DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False)
    with pytest.raises(ConfigError, match="sp_seq_length=9.*not divisible by sp_size 2.*pad_to_multiple_of"):
        ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=9))
    with pytest.raises(ConfigError, match="cp_size 2 and sp_size 2 both shard the sequence; set one of them to 1"):
        ParallelismConfig(sp_size=2, cp_size=2)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    assert ParallelismConfig().sp_size == 2


def _problems(world, **args):
    from test_parallelism import _problems as problems

    return "\n".join(problems(world, **args))


def test_the_parallelism_section_is_checked_before_any_process():
    from test_parallelism import _context

    assert _context(2, **{"parallelism.sp_size": 2}).strategy_cls.name == "fsdp"  # sp alone: FSDP over sp
    assert "sp_seq_length 6 is not divisible by sp_size 4" in _problems(
        4, **{"parallelism.sp_size": 4, "parallelism.sp_seq_length": 6})
    assert "sp_attn_implementation 'flex_attention'" in _problems(
        2, **{"parallelism.sp_size": 2, "parallelism.sp_attn_implementation": "flex_attention"})
    assert "sp_attn_implementation is set but parallelism.sp_size is 1" in _problems(
        2, **{"parallelism.sp_attn_implementation": "sdpa"})
    from torchbay.errors import ConfigError as Invalid

    with pytest.raises(Invalid, match="sp_backend"):  # a name the fsdp plugin's section does not take
        _context(2, **{"parallelism.sp_size": 2, "parallelism.sp_backend": "ring"})
    assert "dp_shard_size 2 x sp_size 2 = 4 processes, but this run has 8" in _problems(
        8, **{"parallelism.dp_shard_size": 2, "parallelism.sp_size": 2})


def _llama(heads=4, kv_heads=2, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8 * heads, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads, **extra))


def test_models_whose_heads_or_attention_cannot_be_split_are_refused():
    from torchbay_fsdp.ulysses.checks import check_model

    check_model(_llama(), 2)
    with pytest.raises(ConfigError, match="num_attention_heads 6, not divisible by sp_size 4.*or use cp_size"):
        check_model(_llama(heads=6, kv_heads=2), 4)
    with pytest.raises(ConfigError, match="num_key_value_heads 1, not divisible by sp_size 2"):
        check_model(_llama(heads=4, kv_heads=1), 2)
    with pytest.raises(ConfigError, match="Linear is not a transformers model.*AttentionInterface"):
        check_model(torch.nn.Linear(2, 2), 2)


def test_the_head_check_counts_the_tensor_parallel_ranks():
    from torchbay_fsdp.ulysses.checks import check_model

    check_model(_llama(heads=8, kv_heads=4), 2, tp=2)  # each tp rank's 4 heads (2 KV heads) split over sp 2
    with pytest.raises(ConfigError, match="num_key_value_heads 2, not divisible by sp_size 2 x tp_size 2 = 4: each tp "
                                          "rank holds heads/2 of them.*whose product divides 2"):
        check_model(_llama(heads=4, kv_heads=2), 2, tp=2)  # divisible by sp alone, not by sp x tp
    with pytest.raises(ConfigError, match="num_attention_heads 6, not divisible by sp_size 2 x tp_size 2 = 4"):
        check_model(_llama(heads=6, kv_heads=6), 2, tp=2)


def test_the_data_loader_shards_the_sequence_with_global_positions_and_the_model_cuts_the_labels():
    from torchbay_fsdp.ulysses.batches import cut_labels, shard_batch

    ids = torch.arange(16).reshape(2, 8)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(2, 8)}
    first, second = (shard_batch(batch, rank, 2) for rank in (0, 1))
    assert "attention_mask" not in first and first["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]] * 2
    # the labels stay whole (a count of labelled tokens, as Trainer's num_items_in_batch, sees the sequence once)
    assert second["labels"].tolist() == ids.tolist() and "shift_labels" not in second
    _, given = cut_labels(1, 2)(None, (), second)  # the model's forward takes its slice of the shifted labels
    assert given["shift_labels"].tolist() == [[5, 6, 7, -100], [13, 14, 15, -100]]
    _, given = cut_labels(0, 2)(None, (), {**first, "shift_labels": ids + 100})  # a collator's own, already shifted
    assert given["shift_labels"].tolist() == [[100, 101, 102, 103], [108, 109, 110, 111]]
    assert cut_labels(0, 2)(None, (), {"input_ids": ids[:, :4], "labels": ids[:, :4]}) is None  # already a slice
    with pytest.raises(ConfigError, match="sequence length 8 is not divisible by sp_size 3.*pad_to_multiple_of=3"):
        shard_batch(batch, 0, 3)
    with pytest.raises(ConfigError, match="attention_mask masks some tokens.*labels -100"):
        shard_batch({**batch, "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}, 0, 2)
    with pytest.raises(ConfigError, match="yields tuple.*yield a dict"):
        shard_batch((ids,), 0, 2)


def test_deepspeeds_data_adapter_is_refused_with_what_to_do():
    from torchbay import Accelerator
    from torchbay.errors import UnsupportedAPIError

    with pytest.raises(UnsupportedAPIError, match="a prepared loader serves each rank's slice of the .*drop the call"):
        Accelerator(cpu=True).deepspeed_ulysses_dl_adapter  # noqa: B018


def test_the_loader_length_is_trainers_until_the_model_is_wrapped():
    """transformers' Trainer multiplies the training loader's length by sp_size (it counts on Accelerate's DeepSpeed
    adapter running each rank's batch on the sp group after the model is prepared): until the strategy has wrapped a
    model the length is the batches divided by sp_size, then the batches."""
    from torchbay_fsdp.ulysses.batches import SequenceShardedBatches

    wrapped = []
    batches = SequenceShardedBatches([{}] * 9, 0, 2, lambda: bool(wrapped))
    assert batches.loop_length() == 4  # rounded down: Trainer then runs 8 of the 9 batches an epoch
    wrapped.append(True)
    assert batches.loop_length() == 9 == len(batches)
