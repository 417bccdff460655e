"""DeepSpeed JSONs from public repositories: the old ``bfloat16`` section with "auto" is read as
DeepSpeed reads it, and fp16 on a device whose DeepSpeed accelerator lacks fp16 is refused before
launch (one line, suggesting bf16 or fp32). No process group starts here."""

import json

import pytest

pytest.importorskip("torchbay_deepspeed")


def test_legacy_bfloat16_section_with_auto_is_filled_as_deepspeed_reads_it(tmp_path, deepspeed_context):
    from torchbay_deepspeed.auto_values import fill_auto
    from torchbay_deepspeed.config import base_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bfloat16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
                                "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}))
    context = deepspeed_context({"mixed_precision": "bf16", "deepspeed.deepspeed_config_file": str(path)})
    cfg, origins, problems = base_config(context.resolved, 2)
    assert problems == [] and cfg["bf16"] == {"enabled": True} and "bfloat16" not in cfg
    filled, _, left = fill_auto(cfg, micro_batch=(4, "test"), world_size=2, model=None, has_optimizer=True)
    assert left == [] and filled["bf16"] == {"enabled": True}


def test_both_bf16_names_are_a_conflict(tmp_path, deepspeed_context):
    from torchbay.errors import IncompatibleSetupError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}))
    with pytest.raises(IncompatibleSetupError, match="old name 'bfloat16'"):
        deepspeed_context({"mixed_precision": "bf16", "deepspeed.deepspeed_config_file": str(path)})


def test_fp16_on_a_device_without_deepspeed_fp16_is_refused_before_launch(tmp_path, monkeypatch, deepspeed_context):
    import torch

    from torchbay.errors import IncompatibleSetupError

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}))
    with pytest.raises(IncompatibleSetupError) as info:
        deepspeed_context({"mixed_precision": "fp16", "deepspeed.deepspeed_config_file": str(path)})
    (line,) = [p for p in info.value.problems if "fp16" in p]
    assert "device 'cpu'" in line and "bf16" in line and "\n" not in line
