"""The fp8 section -> Transformer Engine recipe mapping, as data (no TE needed), and built (TE + FP8 GPU)."""

import importlib.util

import pytest
import torch
from torchbay_fp8 import FP8Config
from torchbay_fp8_te.recipes import build_recipe, recipe_problems, recipe_spec

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
needs_te = pytest.mark.skipif(not (HAS_TE and torch.cuda.is_available()), reason=(
    "transformer_engine is not installed (pip install 'torchbay-fp8-te[engine]')" if not HAS_TE else
    "Transformer Engine needs an NVIDIA GPU"))


def test_te_recipe_mapping_as_data():
    delayed = FP8Config(recipe="delayed", margin=1, amax_history_len=32, amax_compute_algo="most_recent")
    assert recipe_spec(delayed) == ("DelayedScaling", {"fp8_format": "HYBRID", "margin": 1, "amax_history_len": 32,
                                                       "amax_compute_algo": "most_recent"})
    assert recipe_spec(FP8Config(recipe="current", format="E4M3")) == ("Float8CurrentScaling", {"fp8_format": "E4M3"})
    assert recipe_spec(FP8Config())[0] == "Float8CurrentScaling"  # tensorwise = current per-tensor scaling
    not_set = lambda key: False  # noqa: E731
    assert recipe_spec(FP8Config(recipe="mxfp8"), not_set) == ("MXFP8BlockScaling", {"fp8_format": "E4M3"})
    assert recipe_spec(FP8Config(recipe="block"), not_set) == ("Float8BlockScaling", {"fp8_format": "E4M3"})
    extra = FP8Config(recipe="current", engine_options={"recipe_kwargs": {"fp8_dpa": True}})
    assert recipe_spec(extra)[1] == {"fp8_format": "HYBRID", "fp8_dpa": True}
    assert "no rowwise recipe" in recipe_problems(FP8Config(recipe="rowwise"))[0]
    assert "applies to delayed scaling only" in recipe_problems(FP8Config(recipe="current", amax_history_len=8))[0]
    assert recipe_problems(delayed) == []


@needs_te
def test_te_builds_each_recipe():
    from transformer_engine.common import recipe as te_recipe

    delayed = build_recipe(FP8Config(recipe="delayed", margin=1, amax_history_len=32))
    assert isinstance(delayed, te_recipe.DelayedScaling) and delayed.margin == 1 and delayed.amax_history_len == 32
    assert delayed.fp8_format == te_recipe.Format.HYBRID
    assert isinstance(build_recipe(FP8Config(recipe="current")), te_recipe.Float8CurrentScaling)
    if hasattr(te_recipe, "NVFP4BlockScaling"):  # TE 2.8+
        nvfp4 = build_recipe(FP8Config(), lambda key: False, "fp4")
        assert isinstance(nvfp4, te_recipe.NVFP4BlockScaling)
