"""Accelerate's FP8 kwargs handlers on torchbay (issue 40): each gives the ``fp8`` section the equivalent
Accelerate config file gives, says it set the values (the source of each), and a keyword no installed engine can
honour is a config error naming it; under ``TORCHBAY_AS_ACCELERATE=1`` Accelerate's own FP8 test script (its
``tests/test_fp8.py``) converts a model through ``AORecipeKwargs``. The handlers are torchbay-fp8's (served as
``torchbay.utils.<name>``); the tests skip without it and torchbay-fp8-torchao."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from torchbay import Accelerator
from torchbay.compat.config_import import convert, handler_settings
from torchbay.errors import ConfigError, IncompatibleSetupError
from torchbay.launch.plan import describe_source
from torchbay.registry.resolve import resolve_config

pytest.importorskip("torchbay_fp8", reason="torchbay-fp8 is not installed")
pytest.importorskip("torchbay_fp8_torchao", reason="torchbay-fp8-torchao is not installed")
pytest.importorskip("torchao", reason="torchao is not installed")
from torchbay.utils import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SDIST_TESTS = ROOT / ".cache" / "accelerate-sdist" / "accelerate-1.15.0" / "tests"
HF_PYTHON = Path("/work/main/.venv-hf/bin/python")


def from_handler(handler):
    return resolve_config(args={"mixed_precision": "fp8"}, sourced=handler_settings(handler), environ={})


def from_yaml(fp8_config: dict):
    tree, report = convert({"mixed_precision": "fp8", "fp8_config": fp8_config})
    assert not report.not_imported, report.not_imported
    return resolve_config(args=tree, environ={})


def ao_config(recipe: str):
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(recipe)


CASES = {
    "ao": (lambda: AORecipeKwargs(pad_inner_dim=True, enable_fsdp_float8_all_gather=False),
           {"backend": "AO", "pad_inner_dim": True, "enable_fsdp_float8_all_gather": False}),
    "ao-default": (lambda: AORecipeKwargs(), {"backend": "AO"}),
    "te": (lambda: TERecipeKwargs(fp8_format="e4m3", margin=1, amax_history_len=32, amax_compute_algo="max"),
           {"backend": "TE", "fp8_format": "E4M3", "margin": 1, "amax_history_len": 32, "amax_compute_algo": "max"}),
    "te-mxfp8": (lambda: TERecipeKwargs(use_mxfp8_block_scaling=True),
                 {"backend": "TE", "use_mxfp8_block_scaling": True}),
    "te-e5m2": (lambda: TERecipeKwargs(fp8_format="E5M2"), {"backend": "TE", "fp8_format": "E5M2"}),
    "msamp": (lambda: MSAMPRecipeKwargs(opt_level="O1"), {"backend": "MSAMP", "opt_level": "O1"}),
    "deprecated-te": (lambda: FP8RecipeKwargs(backend="te", margin=2), {"backend": "TE", "margin": 2}),
    "deprecated-msamp": (lambda: FP8RecipeKwargs(backend="MSAMP", opt_level="O2"),
                         {"backend": "MSAMP", "opt_level": "O2"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_handler_gives_the_fp8_section_of_the_equivalent_yaml(case):
    make, yaml_section = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        handler = make()
    got = from_handler(handler).config.fp8.model_dump()
    assert got == from_yaml(yaml_section).config.fp8.model_dump()


def test_handler_keeps_accelerates_defaults_on_the_object_not_in_the_config():
    handler = TERecipeKwargs(margin=2)
    assert (handler.amax_history_len, handler.amax_compute_algo, handler.fp8_format) == (1024, "most_recent", "HYBRID")
    fp8 = from_handler(handler).config.fp8
    assert (fp8.backend, fp8.recipe, fp8.margin, fp8.amax_history_len) == ("te", "delayed", 2, 16)
    with pytest.warns(FutureWarning, match="deprecated"):
        FP8RecipeKwargs(backend="TE")


def test_a_torchao_float8_config_is_read_back_into_the_recipe():
    fp8 = from_handler(AORecipeKwargs(config=ao_config("rowwise"))).config.fp8
    assert (fp8.backend, fp8.recipe) == ("torchao", "rowwise")
    from torchao.float8 import Float8LinearConfig

    flipped = not Float8LinearConfig().force_recompute_fp8_weight_in_bwd
    odd = Float8LinearConfig(force_recompute_fp8_weight_in_bwd=flipped)
    with pytest.raises(ConfigError, match=r"AORecipeKwargs\(config=...\).*force_recompute_fp8_weight_in_bwd"):
        handler_settings(AORecipeKwargs(config=odd))


def test_the_source_of_each_value_is_the_handlers_keyword():
    resolved = from_handler(TERecipeKwargs(margin=2, use_mxfp8_block_scaling=False))
    assert describe_source(resolved, "fp8.margin") == "kwargs handler TERecipeKwargs(margin=2)"
    assert describe_source(resolved, "fp8.backend") == "kwargs handler TERecipeKwargs"
    assert resolved.source_of("fp8.recipe") == "kwargs handler TERecipeKwargs(use_mxfp8_block_scaling=False)"
    assert describe_source(resolved, "mixed_precision") == "Accelerator(...) arguments"


def test_what_no_engine_can_honour_is_an_error_naming_the_keyword():
    with pytest.raises(IncompatibleSetupError) as err:  # emulated torchao on one process: no FSDP2 to gather for
        Accelerator(mixed_precision="fp8", config={"fp8": {"emulate": True}},
                    kwargs_handlers=[AORecipeKwargs(enable_fsdp_float8_all_gather=True)])
    assert "(set by kwargs handler AORecipeKwargs(enable_fsdp_float8_all_gather=True))" in str(err.value)
    with pytest.raises(IncompatibleSetupError) as err:  # no Transformer Engine on this CPU
        Accelerator(mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs(margin=1)])
    assert "fp8 backend 'te' cannot run here" in str(err.value) and "set by kwargs handler TERecipeKwargs" in str(
        err.value)
    with pytest.raises(ConfigError, match=r"FP8RecipeKwargs\(opt_level='O1'\): it belongs to the MSAMP backend"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            FP8RecipeKwargs(backend="TE", opt_level="O1")
    with pytest.raises(ConfigError, match=r"TERecipeKwargs configures mixed_precision 'fp8'.*mixed_precision is 'no'"):
        Accelerator(kwargs_handlers=[TERecipeKwargs()])
    with pytest.raises(ConfigError, match="fp8_format='E6M1'"):
        TERecipeKwargs(fp8_format="E6M1")


def test_ao_handler_converts_like_accelerate_and_its_module_filter_decides(caplog):
    from torchao.float8.float8_linear import Float8Linear

    acc = Accelerator(mixed_precision="fp8", config={"fp8": {"emulate": True}},
                      kwargs_handlers=[AORecipeKwargs(module_filter_func=lambda module, fqn: fqn != "2")])
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    model = acc.prepare(model)
    assert [isinstance(m, Float8Linear) for m in model] == [True, True, False, True]
    assert acc.precision.plans[0].skipped["2"] == "left out by the module_filter_func of AORecipeKwargs"


def test_launch_flags_of_accelerate_map_to_the_fp8_section(tmp_path):
    """``accelerate launch``'s FP8 flags set what the same keys of an Accelerate config file set."""
    argv = ["--mixed_precision", "fp8", "--fp8_backend", "te", "--fp8_format", "E4M3", "--fp8_amax_history_len", "8",
            "--fp8_use_mxfp8_block_scaling", "true"]
    shown = _config_show(argv)
    assert (shown["fp8.backend"], shown["fp8.recipe"], shown["fp8.format"], shown["fp8.amax_history_len"]) == (
        "te", "mxfp8", "E4M3", 8)
    shown = _config_show(["--mixed_precision", "fp8", "--fp8_backend", "msamp", "--fp8_opt_level", "O1"])
    assert (shown["fp8.backend"], shown["fp8.engine_options"]) == ("msamp", {"opt_level": "O1"})
    shown = _config_show(["--mixed_precision", "fp8", "--fp8_backend", "ao", "--fp8_pad_inner_dim", "true"])
    assert (shown["fp8.backend"], shown["fp8.engine_options"]) == ("torchao", {"pad_inner_dim": True})


def _config_show(flags: list[str]) -> dict:
    import contextlib
    import io
    import json

    from torchbay.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "show", "--format", "json", *flags]) == 0
    tree = json.loads(out.getvalue())
    flat = {}

    def walk(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict) and k != "engine_options":
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v
    walk(tree.get("config", tree))
    return flat


needs_hf = pytest.mark.skipif(not (HF_PYTHON.exists() and (SDIST_TESTS / "test_fp8.py").exists()),
                              reason="needs /work/main/.venv-hf (transformers) and Accelerate's sdist tests (.cache)")


@needs_hf
def test_accelerates_own_fp8_test_script_converts_through_aorecipekwargs_on_torchbay(tmp_path):
    """Accelerate's ``tests/test_fp8.py`` functions ``can_convert_ao_model`` (with ``AORecipeKwargs``, and from
    the config) run under the switch; ``bert-base-cased`` is replaced by a tiny BERT built offline, and the CPU
    emulates FP8 (``TORCHBAY_FP8__EMULATE``)."""
    code = textwrap.dedent(f"""
        import importlib.util, sys, transformers
        tiny = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=2, vocab_size=128)
        transformers.AutoModelForSequenceClassification.from_pretrained = staticmethod(
            lambda name, **kw: transformers.BertForSequenceClassification(tiny))
        spec = importlib.util.spec_from_file_location("accelerate_test_fp8", {str(SDIST_TESTS / "test_fp8.py")!r})
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        script.can_convert_ao_model(from_config=False)
        script.can_convert_ao_model(from_config=True)
        import accelerate
        print("ran on", accelerate.Accelerator.__module__, repr(accelerate))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env.update(TORCHBAY_AS_ACCELERATE="1", TORCHBAY_FP8__EMULATE="true", TORCHBAY_FP8__BACKEND="torchao",
               TORCHBAY_MIXED_PRECISION="fp8", OMP_NUM_THREADS="1")
    done = subprocess.run([str(HF_PYTHON), "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchbay" in done.stdout.splitlines()[-1]


def test_the_switch_serves_the_handlers_from_torchbay_fp8():
    if importlib.util.find_spec("torchbay") is None:  # pragma: no cover
        pytest.skip("torchbay not importable")
    code = ("import accelerate.utils as u, json; print(json.dumps([u.TERecipeKwargs.__module__, "
            "u.FP8RecipeKwargs.__module__, u.AORecipeKwargs.__module__, u.MSAMPRecipeKwargs.__module__]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBAY_")}
    env["TORCHBAY_AS_ACCELERATE"] = "1"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(eval(done.stdout.strip().splitlines()[-1])) == {"torchbay_fp8.handlers"}  # noqa: S307
