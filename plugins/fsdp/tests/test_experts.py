"""Expert parallelism (issue 39): parallelism.ep_size splits the experts of a torchtitan-style grouped-experts
module and of transformers 5's merged 3-D experts (Mixtral) over ep ranks taken from dp_shard, tokens travel by
all-to-all, non-expert weights are FSDP2-sharded over dp_shard, and training equals the ep 1 single-process run.

Two launches of plugins/fsdp/tests/scripts/experts_train.py: 2 processes (ep 2 = dp_shard 2, the tiny MoE and a
tiny Mixtral) and 4 (dp_shard 4 with ep 2: each half of the experts FSDP-sharded over 2 ranks). Observed: losses
equal to 5e-7, first gradients to 2.3e-8, weights after 3 AdamW steps to 2.2e-6. Each run ends with save_state and
load_state (sharded checkpoints of split experts: test_experts_checkpoint.py for resharding across layouts).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from torchbay.errors import ConfigError
from torchbay.testing.processes import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "experts_train.py")
ATOL = 1e-5
#: steps x global batch x sequence x top-k (the tiny MoE reads 6 tokens of each 7, Mixtral all 7 with labels)
TOKENS_PER_LAYER = {"ep2": 3 * 8 * 6 * 2, "ep2_dp2": 3 * 8 * 6 * 2, "mixtral_ep2": 3 * 8 * 7 * 2}


@pytest.fixture(scope="module", params=[2, 4])
def trained(request, tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp(f"experts{request.param}")
    run_torchrun(SCRIPT, request.param, ["--out", str(out)], timeout=400).check()
    return json.loads((out / f"result_{request.param}.json").read_text())


@pytest.mark.multiprocess
def test_losses_and_weights_equal_the_single_process_run(trained):
    for name, got in trained.items():
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["reference_losses"]), atol=ATOL,
                                   rtol=0)
        assert got["grad_diff"] <= ATOL, (name, got["grad_report"])  # the first step's gradients, whole
        assert got["weight_diff"] <= ATOL, (name, got["weight_diff"], got["worst_weight"])
        # accelerator.get_state_dict / save_model: the whole model, experts gathered, in its original names
        assert got["full_state_dict"]["keys_match"] and got["full_state_dict"]["max_diff"] <= ATOL


@pytest.mark.multiprocess
def test_sharded_checkpoints_of_split_experts_hold_every_expert_and_load_back(trained):
    """save_state with ep (once refused): load_state restores the same weights, and the checkpoint holds the whole
    model in its original names (test_experts_checkpoint.py reshards such checkpoints across layouts)."""
    for name, got in trained.items():
        saved = got["save_state"]
        assert saved["reload_max_diff"] == 0.0, (name, saved)
        assert saved["merged_keys_match"] and saved["merged_max_diff"] == 0.0, (name, saved)


@pytest.mark.multiprocess
def test_the_load_balancing_loss_is_the_single_process_one(trained):
    """Mixtral with output_router_logits (router_aux_loss_coef 0.02): aux loss and total loss of each rank's batch
    at ep 2 equal those of the model in one process without ep on the same batch."""
    if "mixtral_ep2" not in trained:
        pytest.skip("the Mixtral case runs on 2 processes")
    aux = trained["mixtral_ep2"]["aux"]
    assert aux["aux_loss"] > 0
    assert aux["aux_diff"] <= ATOL and aux["loss_diff"] <= ATOL, aux


@pytest.mark.multiprocess
def test_each_rank_holds_its_share_of_the_experts_and_the_load_is_counted(trained):
    for name, got in trained.items():
        experts = 1 if name == "ep2_dp2" else 2  # of 4: split by ep 2, then FSDP over dp_shard / ep
        assert {shape[0] for shape in got["local_expert_shapes"].values()} == {experts}, got["local_expert_shapes"]
        load = got["tokens_per_expert"]
        layers = {key.split("/")[0] for key in load}
        assert len(layers) == 2 and len(load) == 8
        for layer in layers:
            assert sum(v for k, v in load.items() if k.startswith(layer + "/")) == TOKENS_PER_LAYER[name]


# --- no process group ---------------------------------------------------------------------------------------


class Grouped(nn.Module):
    def __init__(self, experts=4):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.zeros(experts, 2, 2)) for _ in range(3))


class Net(nn.Module):
    def __init__(self, experts=4):
        super().__init__()
        self.moe = nn.ModuleDict({"experts": Grouped(experts), "router": nn.Linear(2, experts)})


def test_expert_modules_are_recognised_or_named_and_bad_plans_say_why():
    from torchbay_fsdp.experts.modules import find_experts

    assert list(find_experts(Net(), None, 2)) == ["moe.experts"]
    assert list(find_experts(Net(), ["moe.experts"], 4)) == ["moe.experts"]
    with pytest.raises(ConfigError, match=r"ep_plan \['moe\.ffn'\] matches no module of Net"):
        find_experts(Net(), ["moe.ffn"], 2)
    with pytest.raises(ConfigError, match="moe.router \\(Linear\\) is not a grouped-experts module"):
        find_experts(Net(), ["moe.router"], 2)
    with pytest.raises(ConfigError, match="has 6 experts, not divisible by ep_size 4"):
        find_experts(Net(experts=6), None, 4)
    with pytest.raises(ConfigError, match="Linear has no expert module torchbay recognises.*ep_plan"):
        find_experts(nn.Linear(2, 2), None, 2)


def test_transformers_merged_experts_are_recognised_from_the_models_own_plan():
    pytest.importorskip("transformers")
    from torchbay_fsdp.experts.modules import find_experts
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                               moe_intermediate_size=4, num_hidden_layers=2, num_attention_heads=2,
                                               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2))
    assert list(find_experts(model, None, 2)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_the_parallelism_section_is_checked_before_any_process():
    from test_parallelism import _context, _problems

    assert _context(4, **{"parallelism.dp_shard_size": 4, "parallelism.ep_size": 2}).strategy_cls.name == "fsdp"
    text = "\n".join(_problems(4, **{"parallelism.dp_shard_size": 4, "parallelism.ep_size": 3}))
    assert "ep_size 3 must divide dp_shard_size 4" in text
    text = "\n".join(_problems(4, **{"parallelism.dp_shard_size": 2, "parallelism.tp_size": 2,
                                     "parallelism.ep_size": 2}))
    assert "ep_size 2 with tp_size 2 is not supported yet (ep composes with dp_shard and dp_replicate)" in text
    for name in ("cp", "sp"):
        text = "\n".join(_problems(4, **{"parallelism.dp_shard_size": 2, f"parallelism.{name}_size": 2,
                                         "parallelism.ep_size": 2}))
        assert f"ep_size 2 with {name}_size 2 is not supported yet" in text and "set those sizes to 1" in text
    # HSDP: ep splits each replica's dp_shard ranks (tested in test_experts_checkpoint.py)
    assert _context(4, **{"parallelism.dp_replicate_size": 2, "parallelism.dp_shard_size": 2,
                          "parallelism.ep_size": 2}).strategy_cls.name == "fsdp"
    text = "\n".join(_problems(8, **{"parallelism.dp_replicate_size": 2, "parallelism.dp_shard_size": 4,
                                     "parallelism.ep_size": 3}))
    assert "ep_size 3 must divide dp_shard_size 4" in text
    text = "\n".join(_problems(2, **{"parallelism.ep_plan": ["layers.*.moe.experts"]}))
    assert "ep_plan is set but parallelism.ep_size is 1" in text
    from torchbay import ParallelismConfig

    with pytest.raises(ConfigError, match="ep_size=3\\) must divide dp_shard_size 4"):
        ParallelismConfig(dp_shard_size=4, ep_size=3)
    assert ParallelismConfig(dp_shard_size=4, ep_size=2).to_config()["parallelism.ep_size"] == 2


def test_estimate_memory_takes_ep_size_and_says_what_a_forward_gathers(tmp_path, monkeypatch, capsys):
    from torchbay.testing.cli import run_command

    (tmp_path / "moe_factory.py").write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(SCRIPT)!r})\n"
                                             f"from experts_train import TinyMoE\ndef build():\n    return TinyMoE()\n")
    monkeypatch.chdir(tmp_path)
    assert run_command("estimate-memory", "moe_factory:build", "--num-processes", "4", "--dp-shard-size", "4",
                 "--ep-size", "2", "--format", "json") == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"] if r["precision"] == "-"
            or r["strategy"] == "fsdp"}
    experts = 2 * 3 * 4 * 32 * 16  # layers x (w1, w2, w3) x experts x 2*DIM x DIM
    assert f"ep_size 2: sharded state as without ep; a forward gathers {experts // 2:,} of the {experts:,}" in \
        rows["fsdp"]["note"]
    # HSDP: each replica holds the same per-rank share (experts over dp_shard / ep, the rest over dp_shard)
    assert run_command("estimate-memory", "moe_factory:build", "--num-processes", "4", "--dp-replicate-size", "2",
                       "--dp-shard-size", "2", "--ep-size", "2", "--format", "json") == 0
    hsdp = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"] if r["strategy"] == "fsdp"}
    assert hsdp["fsdp"]["note"] == rows["fsdp"]["note"]
    assert hsdp["fsdp"]["parameters"] == rows["fsdp"]["parameters"] * 2  # dp_shard 2, not 4
