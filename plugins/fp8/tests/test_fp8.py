"""The FP8 precision plugins: torchbay-fp8-torchao (run for real, emulated on CPU),
torchbay-fp8-te and torchbay-fp8-msamp (registration, selection and refusal here; their
conversion, recipe and state code where the engine and an FP8 GPU exist).

Tolerance of FP8 against bf16 (the small regression of plugins/fp8/tests/scripts/fp8_train.py, 80
AdamW steps): both reach a full-data MSE below 5% of the initial one, and FP8's final MSE is
within 25% (relative) of bf16's. Resume is exact: the losses after ``load_state`` equal the
uninterrupted run's bit for bit and so do the final weights.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from torchbay import Accelerator
from torchbay.errors import IncompatibleSetupError
from torchbay.registry.manager import PluginManager, hookimpl, reset_plugin_manager
from torchbay.testing.processes import run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EMULATED = {"fp8": {"backend": "torchao", "engine_options": {"emulate": True}}}
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
HAS_MSAMP = importlib.util.find_spec("msamp") is not None
HAS_FSDP = importlib.util.find_spec("torchbay_fsdp") is not None


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_te = pytest.mark.skipif(not (HAS_TE and _fp8_gpu()), reason=(
    "transformer_engine is not installed (pip install 'torchbay-fp8-te[engine]')" if not HAS_TE else
    "Transformer Engine FP8 needs an NVIDIA GPU of compute capability 8.9+"))
needs_msamp = pytest.mark.skipif(not (HAS_MSAMP and torch.cuda.is_available()), reason=(
    "msamp (MS-AMP) is not installed: it is not on PyPI, see plugins/fp8/msamp/README.md" if not HAS_MSAMP else
    "MS-AMP needs an NVIDIA GPU"))


def mlp(*dims: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


# --- packaging, registration, lazy imports ------------------------------------------------


def test_importing_the_plugins_imports_no_engine():
    code = textwrap.dedent("""
        import sys
        from torchbay.registry.manager import PluginManager
        import torchbay_fp8_torchao.plugin, torchbay_fp8_te.plugin, torchbay_fp8_msamp.plugin
        pm = PluginManager()
        keys = sorted(k for k in pm.registries()["precisions"] if k.startswith("fp8:"))
        pm.hook.torchbay_report_env()
        loaded = [m for m in ("torchao", "transformer_engine", "msamp") if m in sys.modules]
        print(keys, loaded)
        assert keys == ["fp8:msamp", "fp8:te", "fp8:torchao"], keys
        assert not loaded, loaded
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_engine_is_its_own_distribution_with_an_entry_point():
    pm = PluginManager()
    pm.registries()
    for entry, dist in (("fp8-torchao", "torchbay-fp8-torchao"), ("fp8-te", "torchbay-fp8-te"),
                        ("fp8-msamp", "torchbay-fp8-msamp")):
        info = pm.infos[entry]
        assert info.status == "loaded" and info.distribution == dist, info
        assert any(r.startswith("precision:fp8:") for r in info.registers)
    hooks = pm.hooks_of("fp8-torchao")
    assert "torchbay_after_optimizer_step" not in hooks  # a plain Precision method: no per-step hook call
    assert "torchbay_register_precisions" in hooks
    # TE's per-rank FP8 scaling state is its precision's per-rank state, not a plugin-state hook
    assert not {"torchbay_state_extra", "torchbay_load_state_extra"} & set(pm.hooks_of("fp8-te"))
    from torchbay_fp8_te.precision import TransformerEngineFP8Precision

    from torchbay.axes.precision import Precision

    assert TransformerEngineFP8Precision.rank_state_dict is not Precision.rank_state_dict
    # MS-AMP validates and initialises through its selected precision object, not lifecycle hooks
    from torchbay_fp8_msamp.precision import MSAMPFP8Precision

    assert not {"torchbay_validate", "torchbay_prepare"} & set(pm.hooks_of("fp8-msamp"))
    assert MSAMPFP8Precision.prepare is not Precision.prepare and MSAMPFP8Precision.check is not Precision.check


def test_the_fp8_section_and_shared_base_are_their_own_distribution():
    pm = PluginManager()
    assert pm.infos["fp8"].distribution == "torchbay-fp8" and pm.infos["fp8"].status == "loaded"
    from torchbay_fp8 import FP8Config, FP8Precision

    assert pm.config_sections()["fp8"] is FP8Config
    from torchbay.config.model import CoreConfig

    assert "fp8" not in CoreConfig.model_fields  # the core has no fp8 section of its own
    assert importlib.util.find_spec("torchbay.fp8") is None
    assert not glob.glob(os.path.join(ROOT, "plugins/fp8/*/torchbay_fp8_*/_common.py"))
    engines = {k: c for k, c in pm.registries()["precisions"].items() if k.startswith("fp8:")}
    assert sorted(engines) == ["fp8:msamp", "fp8:te", "fp8:torchao"]
    for key, entry in engines.items():
        cls = pm.load_registered(entry)  # the engines register lazily (LazyClass): imported when selected
        assert issubclass(cls, FP8Precision) and cls.name == "fp8" and key == f"fp8:{cls.engine}"
    # the shared checks (engine options, outer bf16 autocast) are written once, in the base
    for path in glob.glob(os.path.join(ROOT, "plugins/fp8/*/torchbay_fp8_*/precision.py")):
        assert "outer_autocast needs" not in open(path).read(), path


def test_fp8_without_an_engine_plugin_names_what_to_install(tmp_path):
    from torchbay.errors import ConfigError
    from torchbay.registry.resolve import resolve_config

    bare = PluginManager(autoload=False)  # the built-in plugins only: no FP8 engine, no fp8 section
    assert "fp8" not in {c.name for c in bare.registries()["precisions"].values()}
    with pytest.raises(ConfigError) as err:
        resolve_config(environ={}, args={"mixed_precision": "fp8"}, pm=bare)
    message = str(err.value)
    assert "'mixed_precision' = 'fp8'" in message and "no installed plugin registers this precision mode" in message
    assert "pip install torchbay-fp8-<engine>" in message
    with pytest.raises(ConfigError, match="pip install torchbay-fp8"):
        resolve_config(environ={}, args={"fp8": {"backend": "torchao"}}, pm=bare)
    with pytest.raises(ConfigError, match="registered: no, bf16, fp16, fp8"):
        resolve_config(environ={}, args={"mixed_precision": "fp9"})


# --- selection ------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_TE, reason="transformer_engine is installed here")
def test_te_without_its_engine_fails_before_training_with_the_install_hint():
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(mixed_precision="fp8", config={"fp8": {"backend": "te"}})
    message = str(err.value)
    assert "fp8 backend 'te' cannot run here" in message
    assert "pip install 'torchbay-fp8-te[engine]'" in message


@pytest.mark.skipif(HAS_MSAMP, reason="msamp is installed here")
def test_msamp_without_its_engine_fails_before_training_with_the_install_hint():
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(mixed_precision="fp8", config={"fp8": {"backend": "msamp"}})
    message = str(err.value)
    assert "fp8 backend 'msamp' cannot run here" in message
    assert "MS-AMP is not on PyPI" in message and "github.com/Azure/MS-AMP" in message


def test_torchao_on_cpu_needs_emulation_opt_in_and_says_so():
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(mixed_precision="fp8", config={"fp8": {"backend": "torchao"}})
    assert "no FP8 hardware path on device 'cpu'" in str(err.value)
    assert "fp8.emulate: true" in str(err.value)


def test_auto_says_which_engine_it_chose_and_why(caplog):
    caplog.set_level(logging.INFO)
    acc = Accelerator(mixed_precision="fp8", config={"fp8": {"engine_options": {"emulate": True}}})
    assert acc.precision.engine == "torchao" and acc.fp8_backend == "torchao"
    chose = [r.getMessage() for r in caplog.records if "auto chose" in r.getMessage()]
    assert chose and "'torchao'" in chose[0]
    if not HAS_TE:
        assert "te: its engine 'transformer_engine' is not installed" in chose[0]
    assert "msamp" not in chose[0]  # lowest priority: never reached once torchao is usable
    assert acc.precision.describe() == "fp8:torchao:tensorwise:emulated"


def test_settings_an_engine_cannot_honour_are_all_reported_by_name():
    cfg = {"fp8": {"backend": "torchao", "recipe": "delayed", "margin": 2, "amax_history_len": 32,
                   "engine_options": {"emulate": True, "emulat": True}}}
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(mixed_precision="fp8", config=cfg)
    problems = err.value.problems
    assert any("fp8 engine 'torchao' cannot honour fp8.recipe = 'delayed'" in p for p in problems)
    assert any("fp8.margin = 2" in p for p in problems)
    assert any("fp8.amax_history_len = 32" in p for p in problems)
    assert any("fp8.engine_options.emulat" in p and "did you mean 'emulate'" in p for p in problems)
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(mixed_precision="fp8", config={"fp8": {"backend": "torchao", "engine_options": {
            "emulate": True, "enable_fsdp_float8_all_gather": True}}})
    assert "needs strategy: fsdp" in str(err.value)


def _fake_context(**fp8):
    from torchbay_fp8 import FP8Config

    class NoBF16:  # a device without bf16 autocast
        name = "nobf16"

        @staticmethod
        def supports_autocast(dtype):
            return dtype != torch.bfloat16

        @staticmethod
        def torch_type():
            return "cpu"

    config = SimpleNamespace(fp8=FP8Config(**fp8), strategy="single")
    return SimpleNamespace(config=config, device_backend_cls=NoBF16, device_backend=None, strategy_cls=None,
                           resolved=SimpleNamespace(source_of=lambda key: "default"))


def test_every_engine_gets_the_shared_checks_from_the_base():
    pm = PluginManager()
    for key, cls in pm.registries()["precisions"].items():
        if not key.startswith("fp8:"):
            continue
        problems = cls.check(_fake_context(engine_options={"no_such_option": 1}))
        autocast = [p for p in problems if "fp8.outer_autocast needs bf16 autocast" in p]
        assert len(autocast) == 1 and "set fp8.outer_autocast: false" in autocast[0], (key, problems)
        assert any(f"not an option of fp8 engine '{cls.engine}'" in p for p in problems), (key, problems)
        assert not [p for p in cls.check(_fake_context(outer_autocast=False)) if "outer_autocast" in p]


def test_msamp_under_deepspeed_zero3_is_refused_before_any_process_group(monkeypatch):
    """Through Accelerator: with the deepspeed plugin if installed, else a stand-in strategy."""
    pm = PluginManager()
    if "deepspeed" not in pm.registries()["strategies"]:
        from pydantic import BaseModel, ConfigDict

        from torchbay.axes.strategy import Strategy

        class Section(BaseModel):
            model_config = ConfigDict(extra="forbid")
            zero_stage: int = 2

        class StandIn(Strategy):
            name = "deepspeed"

        class Plugin:
            @hookimpl
            def torchbay_register_strategies(self):
                return [StandIn]

            @hookimpl
            def torchbay_config_sections(self):
                return {"deepspeed": Section}

        pm.register_plugin(Plugin(), "deepspeed-stand-in")
    reset_plugin_manager(pm)
    with pytest.raises(IncompatibleSetupError) as err:
        Accelerator(mixed_precision="fp8", strategy="deepspeed",
                    config={"fp8": {"backend": "msamp"}, "deepspeed": {"zero_stage": 3}})
    assert any("fp8 engine 'msamp' does not run under strategy: deepspeed" in p and "ZeRO-3" in p
               for p in err.value.problems)
    assert not torch.distributed.is_initialized()


# --- which modules are converted -------------------------------------------------------------


def test_small_layers_are_named_in_one_warning_before_training(caplog):
    caplog.set_level(logging.INFO)
    acc = Accelerator(mixed_precision="fp8", config=EMULATED)
    acc.prepare(mlp(64, 64, 64, 64, 64))
    warnings = [r.getMessage() for r in caplog.records if "too small" in r.getMessage()]
    assert len(warnings) == 1 and "2 of 2 FP8 layer(s)" in warnings[0] and "2 (64->64), 4 (64->64)" in warnings[0]
    caplog.clear()
    quiet = {"fp8": {"backend": "torchao", "engine_options": {"emulate": True, "small_layer_threshold": 0}}}
    Accelerator(mixed_precision="fp8", config=quiet).prepare(mlp(64, 64, 64, 64))
    assert not [r for r in caplog.records if "too small" in r.getMessage()]


def test_converted_modules_are_listed_and_separate_prepare_calls_train_them(caplog):
    from torchao.float8.float8_linear import Float8Linear

    caplog.set_level(logging.INFO)
    acc = Accelerator(mixed_precision="fp8", config=EMULATED)
    model = mlp(32, 64, 64, 64, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = acc.prepare(optimizer)   # the optimizer first, in its own call
    model = acc.prepare(model)
    assert acc.precision.converted == [["2", "4"]]
    assert [type(model[i]) for i in (0, 2, 4, 6)] == [torch.nn.Linear, Float8Linear, Float8Linear, torch.nn.Linear]
    listed = [r.getMessage() for r in caplog.records if "converted to FP8" in r.getMessage()]
    assert listed and "2 Linear module(s) converted to FP8: 2 (64->64), 4 (64->64)" in listed[0]
    assert "6: last Linear kept" in listed[0] or "6: shape" in listed[0]
    before = model[2].weight.detach().clone()
    loss = model(torch.randn(16, 32)).float().pow(2).mean()
    acc.backward(loss)
    optimizer.step()
    assert not torch.equal(before, model[2].weight.detach()), "the optimizer did not update the FP8 layer"


def test_load_state_with_other_converted_modules_says_what_changed(tmp_path, caplog):
    """torchao's dynamic scaling keeps no state: a checkpoint whose layers had other recipes resumes, with a notice
    naming each layer that changed."""

    def prepared(exclude):
        acc = Accelerator(mixed_precision="fp8", config={"fp8": {**EMULATED["fp8"], "exclude": exclude}})
        model = mlp(32, 64, 64, 64, 8)
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return acc

    prepared([]).save_state(str(tmp_path / "ckpt"))
    caplog.set_level(logging.WARNING)
    prepared(["^4$"]).load_state(str(tmp_path / "ckpt"))
    said = [r.getMessage() for r in caplog.records if "other recipes" in r.getMessage()]
    assert said and "1 change(s): 4: tensorwise -> high precision" in said[0]


def test_recipe_and_format_map_to_torchao_configs():
    from torchao.float8.config import ScalingGranularity

    def config_for(fp8):
        acc = Accelerator(mixed_precision="fp8", config={"fp8": {"backend": "torchao", **fp8,
                                                                 "engine_options": {"emulate": True}}})
        return acc.precision.float8_config()

    tensorwise = config_for({})
    assert tensorwise.emulate and tensorwise.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
    assert tensorwise.cast_config_grad_output.target_dtype == torch.float8_e5m2          # HYBRID
    assert config_for({"format": "E4M3"}).cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    rowwise = config_for({"recipe": "rowwise"})
    assert rowwise.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
    assert rowwise.round_scales_to_power_of_2
    assert rowwise.cast_config_grad_output.target_dtype == torch.float8_e4m3fn  # torchao's rowwise default
    assert config_for({"recipe": "current"}) == tensorwise


# --- training: single process, DDP, FSDP2 -----------------------------------------------------


def _check_run(r, strategy):
    bf16, fp8, resumed = r["bf16"], r["fp8"], r["resume"]
    assert fp8["strategy"] == strategy and fp8["precision"] == "fp8:torchao:tensorwise:emulated"
    assert fp8["converted"] == [["2", "4"]] and "Float8Linear" in fp8["modules"]
    assert bf16["final"] < 0.05 * r["initial"] and fp8["final"] < 0.05 * r["initial"], r
    assert abs(fp8["final"] - bf16["final"]) <= 0.25 * bf16["final"], (fp8["final"], bf16["final"])
    # resume: the steps after load_state are the uninterrupted run's, bit for bit
    assert len(resumed["losses"]) == 80 - 50
    assert resumed["losses"] == fp8["losses"][50:]
    assert resumed["final"] == fp8["final"]
    assert resumed["digest"] == fp8["digest"]


def test_emulated_fp8_training_single_process_converges_like_bf16_and_resumes_exactly(tmp_path):
    spec = importlib.util.spec_from_file_location("fp8_train",
                                                  os.path.join(ROOT, "plugins/fp8/tests/scripts/fp8_train.py"))
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.main(["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run")])
    _check_run(json.load(open(tmp_path / "run.single.rank0.json")), "single")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """One torchrun launch (2 gloo processes) trains under ddp, then fsdp when installed."""
    tmp = tmp_path_factory.mktemp("fp8_two_process")
    strategies = "ddp,fsdp" if HAS_FSDP else "ddp"
    run_torchrun(os.path.join(ROOT, "plugins/fp8/tests/scripts/fp8_train.py"), 2,
                 ["--strategies", strategies, "--batch-size", "8", "--ckpt", str(tmp / "ckpt"),
                  "--out", str(tmp / "run")],
                 timeout=400).check()
    return {s: [json.load(open(tmp / f"run.{s}.rank{r}.json")) for r in range(2)] for s in strategies.split(",")}


@pytest.mark.multiprocess
def test_emulated_fp8_ddp_two_processes_converges_like_bf16_and_resumes_exactly(two_process_runs):
    ranks = two_process_runs["ddp"]
    for r in ranks:
        _check_run(r, "ddp")
    assert ranks[0]["fp8"]["losses"] == ranks[1]["fp8"]["losses"]  # reduced across ranks
    assert ranks[0]["fp8"]["digest"] == ranks[1]["fp8"]["digest"]  # replicas stay identical


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_FSDP, reason="torchbay-fsdp (plugins/fsdp) is not installed")
def test_emulated_fp8_fsdp2_two_processes_all_gathers_fp8_and_resumes_exactly(two_process_runs):
    ranks = two_process_runs["fsdp"]
    for r in ranks:
        _check_run(r, "fsdp")
        assert r["fp8"]["fsdp_float8_weights"] == ["0:2.weight", "0:4.weight"], "weights not all-gathered in FP8"
        assert r["fp8"]["scale_precomputations"] == 80  # after every optimizer step
        assert r["resume"]["scale_precomputations"] == 30 + 1  # and once after load_state
    assert ranks[0]["fp8"]["losses"] == ranks[1]["fp8"]["losses"]


# --- Transformer Engine -----------------------------------------------------------------------


@needs_te
def test_te_converts_linear_and_layernorm_keeping_parameters(tmp_path):
    import transformer_engine.pytorch as te

    # a tiny model: the small-layer filter would leave its Linear in bf16 (this test is about conversion)
    acc = Accelerator(mixed_precision="fp8", config={"fp8": {"backend": "te", "recipe": "delayed",
                                                             "filter_small_layers": False}})
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = {id(p) for p in model.parameters()}
    optimizer = acc.prepare(optimizer)
    model = acc.prepare(model)  # a separate call, after the optimizer
    assert isinstance(model[2], te.Linear) and isinstance(model[1], te.LayerNorm)
    assert type(model[0]) is torch.nn.Linear and type(model[4]) is torch.nn.Linear  # first and last kept
    assert {id(p) for p in model.parameters()} == params
    x = torch.randn(32, 64, device=acc.device)
    for _ in range(3):
        acc.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    acc.save_state(str(tmp_path / "ckpt"))
    saved = acc.precision.scaling_state()
    acc.backward(model(x).float().pow(2).mean())  # moves the amax history on
    acc.load_state(str(tmp_path / "ckpt"))
    restored = acc.precision.scaling_state()
    for key, value in saved["modules"].items():
        assert torch.equal(value, restored["modules"][key]), key


@needs_msamp
def test_msamp_initialises_model_and_optimizer_together():
    acc = Accelerator(mixed_precision="fp8", config={"fp8": {"backend": "msamp", "keep_first_and_last": False}})
    model = mlp(64, 128, 64).to(acc.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    assert type(acc.unwrap_model(model)[0]).__module__.startswith("msamp")
    assert type(optimizer.optimizer).__module__.startswith("msamp")
    acc.backward(model(torch.randn(8, 64, device=acc.device)).float().pow(2).mean())
    optimizer.step()


# --- out of the box: the small-layer filter and compiling ---------------------------------------


def test_the_small_layer_filter_leaves_layers_too_small_to_gain_in_higher_precision(caplog):
    caplog.set_level(logging.INFO)
    filtered = {"fp8": {**EMULATED["fp8"], "filter_small_layers": True}}
    acc = Accelerator(mixed_precision="fp8", config=filtered)
    # 2048x2048: K*N/(K+N) = 1024, gains; 2048->512: 410, too small; first and last are kept anyway
    model = acc.prepare(mlp(16, 2048, 2048, 512, 512, 16))
    assert acc.precision.converted == [["2"]]
    plan = acc.precision.plans[0]
    assert plan.skipped["4"].startswith("too small to gain from FP8: K*N/(K+N) = 410 < 1024")
    assert "6" in plan.skipped and "too small" in plan.skipped["6"]
    listed = [r.getMessage() for r in caplog.records if "converted to FP8" in r.getMessage()]
    assert len(listed) == 1 and "4: too small to gain from FP8" in listed[0]
    assert type(model[4]) is torch.nn.Linear
    # unset, the filter is on where FP8 runs for real and off in emulation (speed means nothing there)
    assert Accelerator(mixed_precision="fp8", config=EMULATED).precision.small_layer_filter() == 0
    precision = Accelerator(mixed_precision="fp8", config=EMULATED).precision
    precision.emulate = False
    assert precision.small_layer_filter() == 1024
    off = {"fp8": {**EMULATED["fp8"], "filter_small_layers": False}}
    precision = Accelerator(mixed_precision="fp8", config=off).precision
    precision.emulate = False
    assert precision.small_layer_filter() == 0


def test_torchao_fp8_asks_to_be_compiled_only_where_it_runs_fp8_kernels():
    acc = Accelerator(mixed_precision="fp8", config=EMULATED)
    model = acc.prepare(mlp(32, 64, 64, 64, 8))
    assert acc._compiler.compiled == []  # emulated: compile.enabled auto does not compile
    precision = acc.precision
    assert precision.compile_reason(model) is None
    precision.emulate = False  # the same decision on an FP8 GPU
    assert "only under torch.compile" in precision.compile_reason(model)
    assert "compile.enabled: auto" in acc._compiler.reason(model)
    assert precision.compile_reason(mlp(32, 64)) is None  # a model it did not convert


def test_emulated_fp8_compiled_trains_as_uncompiled():
    def losses(compile_section):
        torch.manual_seed(0)
        acc = Accelerator(mixed_precision="fp8", config={**EMULATED, "compile": compile_section})
        model = mlp(32, 64, 64, 64, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = acc.prepare(model, optimizer)
        out = []
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            loss = model(torch.randn(16, 32, generator=gen).to(acc.device)).float().pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out, acc._compiler.compiled

    eager, none = losses({"enabled": False})
    compiled, which = losses({"enabled": True, "backend": "aot_eager"})
    assert none == [] and which == [["<root>"]]
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)


def test_accelerates_torchao_helpers_convert_the_same_layers_as_accelerate():
    pytest.importorskip("torchao", reason="torchao converts the layers")
    accelerate_ao = pytest.importorskip("accelerate.utils.ao", reason="Accelerate (a dev dependency) is the reference")
    from torchao.float8.float8_linear import Float8Linear
    from torchbay_fp8_torchao import compat as ours_ao  # served as torchbay.utils.* (accelerate.yaml plugin_names)

    def toy():
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                                    torch.nn.Linear(48, 8))
        return torch.nn.Sequential(torch.nn.Linear(32, 64), block, torch.nn.Linear(8, 32))

    def converted(convert, **kwargs):
        model = toy()
        convert(model, **kwargs)
        return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]

    ours, theirs = converted(ours_ao.convert_model_to_fp8_ao), converted(accelerate_ao.convert_model_to_fp8_ao)
    assert ours == theirs == ["1.0", "1.2"]  # not the first nor the last Linear; 48 -> 8 is no multiple of 16
    only_first = dict(module_filter_func=lambda module, fqn: fqn == "0")
    assert converted(ours_ao.convert_model_to_fp8_ao, **only_first) == ["0"]
    assert ours_ao.find_first_last_linear_layers(toy()) == accelerate_ao.find_first_last_linear_layers(toy())
    model = toy()
    assert not ours_ao.has_ao_layers(model)
    ours_ao.convert_model_to_fp8_ao(model)
    assert ours_ao.has_ao_layers(model) and accelerate_ao.has_ao_layers(model)
