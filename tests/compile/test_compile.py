"""torch.compile as a step of prepare (the ``compile`` section, torchbay.compile.compiler).

Compiled runs use aot_eager (or a backend that counts graphs and delegates to it): the same
kernels as eager, so the losses of a compiled run equal the uncompiled run's bit for bit, and
the count shows that compiled code ran. Inductor is what a GPU run uses; compiling with it on
this CPU would only make the tests slow.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import sys

import pytest
import torch

import torchbay.utils
from torchbay import Accelerator
from torchbay.compile.compiler import (
    DynamoBackend,
    TorchDynamoPlugin,
    compile_regions,
    has_compiled_regions,
    is_compiled,
    repeated_blocks,
)
from torchbay.errors import ConfigError, IncompatibleSetupError
from torchbay.testing.processes import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_FSDP = importlib.util.find_spec("torchbay_fsdp") is not None
HAS_TORCHAO = importlib.util.find_spec("torchbay_fp8_torchao") is not None
AOT_EAGER = {"compile": {"enabled": True, "backend": "aot_eager"}}


@functools.lru_cache(maxsize=None)  # loaded once: it registers its counting backend by name
def _worker():
    spec = importlib.util.spec_from_file_location("compile_train", os.path.join(ROOT, "tests/scripts/compile_train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["compile_train"] = module  # dynamo imports the module of the functions it traces
    spec.loader.exec_module(module)
    return module


# --- config and Accelerate's arguments ------------------------------------------------------------


def test_compiling_is_off_by_default_and_the_prepared_model_is_untouched():
    acc = Accelerator()
    assert acc.config.compile.enabled == "auto"
    model = acc.prepare(torch.nn.Linear(4, 4))
    assert not is_compiled(model) and acc._compiler.compiled == []


@pytest.mark.parametrize("arguments", [
    {"dynamo_backend": "no"}, {"dynamo_backend": "NO"}, {"dynamo_backend": DynamoBackend.NO},
    {"dynamo_plugin": TorchDynamoPlugin(backend=None)},  # what transformers' Trainer always passes
    {"dynamo_plugin": TorchDynamoPlugin(backend=None, mode="default", fullgraph=False, dynamic=None,
                                        use_regional_compilation=False)},
    {"dynamo_backend": None, "dynamo_plugin": None}])
def test_accelerates_no_compile_arguments_are_accepted_and_compile_nothing(arguments):
    acc = Accelerator(**arguments)
    assert acc.config.compile.enabled == "auto" and acc.context.resolved.source_of("compile.enabled") == "default"
    model = acc.prepare(torch.nn.Linear(4, 4))
    assert not is_compiled(model) and acc._compiler.compiled == []


def test_accelerates_dynamo_arguments_map_to_the_compile_section():
    acc = Accelerator(dynamo_backend="AOT_EAGER")
    assert (acc.config.compile.enabled, acc.config.compile.backend) == (True, "aot_eager")
    acc = Accelerator(dynamo_backend=DynamoBackend.EAGER)
    assert acc.config.compile.backend == "eager"
    plugin = TorchDynamoPlugin(backend=DynamoBackend.AOT_EAGER, mode="default", fullgraph=True, dynamic=False,
                               use_regional_compilation=True)
    section = Accelerator(dynamo_plugin=plugin).config.compile
    assert (section.enabled, section.backend, section.mode, section.fullgraph, section.dynamic, section.regional) == \
        (True, "aot_eager", None, True, False, True)
    assert plugin.to_kwargs() == {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    disabled = TorchDynamoPlugin(backend="inductor", disable=True)
    assert Accelerator(dynamo_plugin=disabled).config.compile.enabled is False


def test_conflicting_or_foreign_dynamo_arguments_are_refused():
    with pytest.raises(ConfigError, match="both dynamo_backend and dynamo_plugin"):
        Accelerator(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="aot_eager"))

    class ForeignPlugin:  # e.g. accelerate's own TorchDynamoPlugin, outside the compat mode
        backend = "inductor"

    with pytest.raises(ConfigError, match="takes torchbay.utils.TorchDynamoPlugin"):
        Accelerator(dynamo_plugin=ForeignPlugin())


def test_compile_settings_are_checked_before_any_process_group():
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(config={"compile": {"enabled": True, "backend": "no_such_backend", "mode": "max-autotune",
                                        "options": {"trace.enabled": True}}})
    text = str(err.value)
    assert "compile.backend 'no_such_backend' is not a torch.compile backend" in text and "aot_eager" in text
    assert "compile.mode and compile.options cannot both be set" in text
    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="compile.mode"):
        Accelerator(config={"compile": {"mode": "fastest"}})


def test_the_utils_names_are_torchbays():
    import torchbay.utils

    assert torchbay.utils.TorchDynamoPlugin is TorchDynamoPlugin and torchbay.utils.DynamoBackend is DynamoBackend
    assert torchbay.utils.compile_regions is compile_regions
    assert torchbay.utils.has_compiled_regions is has_compiled_regions


# --- what is compiled ------------------------------------------------------------------------------


def test_regional_compilation_returns_a_twin_with_each_repeated_block_compiled_as_accelerate_does():
    net = _worker().Net()
    blocks = repeated_blocks(net)
    assert blocks == list(net.blocks)
    assert not has_compiled_regions(net)
    twin = compile_regions(net, backend="aot_eager")
    assert twin is not net and type(twin) is type(net) and not has_compiled_regions(net)  # the user's model unchanged
    optimized = torch._dynamo.eval_frame.OptimizedModule
    assert has_compiled_regions(twin) and all(isinstance(b, optimized) for b in twin.blocks)
    assert [b._orig_mod for b in twin.blocks] == list(net.blocks) and is_compiled(twin.head)  # leaves outside: whole
    assert twin.blocks[0]._orig_mod.linear.weight is net.blocks[0].linear.weight  # parameters shared
    assert torchbay.utils.extract_model_from_parallel(twin, keep_torch_compile=False) is net
    x = torch.randn(2, net.embed.in_features)
    torch.testing.assert_close(twin(x), net(x))
    # a module built of torch's own classes compiles too (Module.compile alone leaves nn.Sequential eager)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    graphs = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward

    compile_regions(seq, backend=counting)(torch.randn(2, 4))
    assert len(graphs) == 1


def test_regional_without_repeated_blocks_compiles_the_whole_model_and_says_so(caplog):
    acc = Accelerator(config={"compile": {**AOT_EAGER["compile"], "regional": True}})
    with caplog.at_level(logging.WARNING, logger="torchbay"):
        model = acc.prepare(torch.nn.Linear(4, 4))
    assert is_compiled(model) and acc._compiler.compiled == [["<root>"]]
    assert any("has no repeated blocks" in r.getMessage() for r in caplog.records)


def _check_equal_to_eager(result: dict, strategy: str) -> None:
    eager = result["eager"]
    for kind in ("whole", "regional"):
        run = result[kind]
        assert run["losses"] == eager["losses"], (kind, run["losses"], eager["losses"])
        assert run["weight_sum"] == eager["weight_sum"] and run["state_keys"] == eager["state_keys"]
        assert run["unwrapped_is_user_module"]
    blocks = [f"blocks.{i}" for i in range(6)]
    assert result["regional"]["compiled"] == [blocks]
    assert result["whole"]["compiled"] == ([blocks] if strategy == "fsdp" else [["<root>"]])
    assert result["whole"]["graphs"], "no graph was compiled"
    if strategy == "ddp":  # compiled inside DDP's forward: torch split the graph at the gradient buckets
        assert len(result["whole"]["graphs"]) >= 2, result["whole"]["graphs"]
    if "fp8_compiled" in result:  # FP8 conversion, then the strategy, then compile: FP8's own numbers
        fp8, compiled = result["fp8_eager"], result["fp8_compiled"]
        assert compiled["losses"] == fp8["losses"] and compiled["weight_sum"] == fp8["weight_sum"]
        assert compiled["converted"] == fp8["converted"] == [[f"blocks.{i}.linear" for i in range(6)]]
        assert compiled["graphs"] and compiled["compiled"] == result["whole"]["compiled"]
        if strategy == "fsdp":  # torchao's FP8 all-gather survives compiling the blocks
            assert compiled["fp8_weights"] == [f"0:blocks.{i}.linear.weight" for i in range(6)]
    elif HAS_TORCHAO:
        raise AssertionError("the worker ran no FP8 case")
    if "whole_accumulate" in result:  # no_sync on the micro-batches that do not end a window
        assert result["whole_accumulate"]["losses"] == result["eager_accumulate"]["losses"]
        assert result["whole_accumulate"]["weight_sum"] == result["eager_accumulate"]["weight_sum"]


def test_single_process_compiled_training_equals_eager(tmp_path):
    _worker().main(["--out", str(tmp_path / "run")])
    _check_equal_to_eager(json.load(open(tmp_path / "run.single.rank0.json")), "single")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """One torchrun launch (2 gloo processes): ddp, then fsdp (FSDP2) when installed."""
    tmp = tmp_path_factory.mktemp("compile_two_process")
    strategies = "ddp,fsdp" if HAS_FSDP else "ddp"
    run_torchrun(os.path.join(ROOT, "tests/scripts/compile_train.py"), 2,
                 ["--strategies", strategies, "--out", str(tmp / "run")], timeout=400).check()
    return {s: [json.load(open(tmp / f"run.{s}.rank{r}.json")) for r in range(2)] for s in strategies.split(",")}


@pytest.mark.multiprocess
def test_ddp_two_processes_compiled_training_equals_eager(two_process_runs):
    for result in two_process_runs["ddp"]:
        _check_equal_to_eager(result, "ddp")
    assert two_process_runs["ddp"][0]["whole"]["losses"] == two_process_runs["ddp"][1]["whole"]["losses"]


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_FSDP, reason="torchbay-fsdp (plugins/fsdp) is not installed")
def test_fsdp2_two_processes_compiles_each_sharded_block_and_equals_eager(two_process_runs):
    for result in two_process_runs["fsdp"]:
        _check_equal_to_eager(result, "fsdp")
    # the same numbers as DDP: sharding and compiling change neither
    assert two_process_runs["fsdp"][0]["whole"]["losses"] == two_process_runs["ddp"][0]["eager"]["losses"]


def test_evaluation_mode_models_are_compiled_too():
    acc = Accelerator(config=AOT_EAGER)
    model = acc.prepare_model(torch.nn.Linear(4, 4), evaluation_mode=True)
    assert is_compiled(model)
    x = torch.ones(1, 4, device=acc.device)
    with torch.no_grad():
        assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))


@pytest.mark.skipif(importlib.util.find_spec("torchbay_deepspeed") is None or importlib.util.find_spec("deepspeed")
                    is None, reason="torchbay-deepspeed or deepspeed is not installed")
def test_deepspeed_zero2_compiled_training_equals_eager_with_one_graph():
    """The forward is compiled, not the engine's hooks: DeepSpeed's step-counting pre-hook read
    inside the graph would recompile it at every step."""
    worker = _worker()

    def run(compile_section):
        acc = Accelerator(strategy="deepspeed", seed=0, config={
            "compile": compile_section, "deepspeed": {"zero_stage": 2, "train_micro_batch_size_per_gpu": 8}})
        torch.manual_seed(1)
        user_model = worker.Net()
        model, optimizer = acc.prepare(user_model, torch.optim.SGD(user_model.parameters(), lr=0.01))
        before, losses = len(worker.GRAPHS), []
        for x, y in worker.batches(0, 5):
            loss = torch.nn.functional.mse_loss(model(x.to(acc.device)), y.to(acc.device))
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert acc.unwrap_model(model) is user_model
        acc.end_training()
        return losses, worker.GRAPHS[before:]

    eager, _ = run({"enabled": False})
    torch._dynamo.reset()  # an earlier test's compiled Net would be reused: compile it afresh
    compiled, graphs = run({"enabled": True, "backend": "torchbay_counting"})
    assert compiled == eager and len(graphs) == 1, graphs


def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights():
    """An EMA or teacher copy made after prepare must not call back into the original."""
    import copy

    acc = Accelerator(config=AOT_EAGER)
    model = acc.prepare(torch.nn.Linear(4, 4))
    twin = copy.deepcopy(model)
    assert is_compiled(twin)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
        x = torch.ones(2, 4, device=acc.device)
        assert torch.equal(twin(x), torch.zeros(2, 4, device=acc.device))
        assert not torch.equal(model(x), torch.zeros(2, 4, device=acc.device))


def test_a_deep_copy_of_a_mixed_precision_compiled_model_runs_its_own_weights():
    import copy

    acc = Accelerator(mixed_precision="bf16", config=AOT_EAGER)
    model = acc.prepare(torch.nn.Linear(4, 4))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
        x = torch.ones(2, 4, device=acc.device)
        assert torch.equal(twin(x), torch.zeros(2, 4, device=acc.device)) and twin(x).dtype == torch.float32
        assert not torch.equal(model(x), torch.zeros(2, 4, device=acc.device))
    plain = acc.unwrap_model(twin, keep_fp32_wrapper=False)
    assert plain is twin and "_torchbay_original_forward" not in plain.__dict__
    assert not is_compiled(plain)  # keep_fp32_wrapper=False restored the user's forward, uncompiled


def test_the_prepared_forward_shows_the_users_signature():
    """transformers' Trainer keeps the dataset columns that model.forward names."""
    import inspect

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, input_ids, labels=None, **kwargs):
            return self.linear(input_ids)

    for mixed, config in (("bf16", None), ("bf16", AOT_EAGER), ("no", AOT_EAGER)):
        model = Accelerator(mixed_precision=mixed, config=config).prepare(Model())
        assert str(inspect.signature(model.forward)) == "(input_ids, labels=None, **kwargs)", (mixed, config)
