"""``DeviceBackend.peak_flops`` (plugin API 1.3) of the device plugins: the published figures by device identity,
``None`` (unknown, never a guess) for what a table cannot identify, and the real GPU's answer where one is present."""

from __future__ import annotations

import pytest
import torch
from torchbay_cuda.peaks import identify, peak_flops_of
from torchbay_hpu.plugin import gaudi_peak_flops
from torchbay_xla.plugin import tpu_peak_flops

from torchbay.plugin import DeviceBackend, flops_key


def test_flops_key_names_dtypes_and_strings():
    assert [flops_key(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.int8, torch.float64)] == ["bf16", "fp16", "fp32", "fp8", None, None]
    assert [flops_key(s) for s in ("bf16", "BF16", "float16", "fp8", "tf32", "int4")] == \
        ["bf16", "bf16", "fp16", "fp8", "tf32", None]


@pytest.mark.parametrize("name, product, bf16_tflops", [
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0), ("NVIDIA A100-PCIE-40GB", "A100", 312.0),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4), ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5), ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5), ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA GH200 480GB", "GH200", 989.4), ("AMD Instinct MI300X", "MI300X", 1307.4),
    ("AMD Instinct MI325X", "MI325X", 1307.4)])
def test_cuda_table_identifies_each_product(name, product, bf16_tflops):
    found = identify(name)
    assert found is not None and found[0] == product
    assert peak_flops_of(name, "bf16") == pytest.approx(bf16_tflops * 1e12)


def test_cuda_table_never_guesses():
    assert identify("NVIDIA H100") is None  # SXM or PCIe? the name does not say
    assert peak_flops_of("NVIDIA GeForce GTX 1080", "bf16") is None
    assert peak_flops_of("NVIDIA A100-SXM4-80GB", "fp8") is None  # A100 has no FP8
    assert peak_flops_of("NVIDIA B200", "fp4") == pytest.approx(9e15)
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(2 * peak_flops_of("NVIDIA H100 80GB HBM3",
                                                                                               "bf16"), rel=1e-3)


def test_other_vendors_figures_and_unknowns():
    assert gaudi_peak_flops("GAUDI3", "bf16") == pytest.approx(1835e12)
    assert gaudi_peak_flops("GAUDI2", "bf16") is None
    assert tpu_peak_flops("TPU v5 lite", "bf16") == pytest.approx(197e12)
    assert tpu_peak_flops("TPU v5 lite", "fp32") is None
    assert DeviceBackend.peak_flops(object(), "bf16") is None  # the base: unknown


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA missing: the real GPU's peak is checked on a GPU")
def test_cuda_backend_answers_for_the_present_gpu():
    from torchbay_cuda.plugin import CUDABackend

    name = torch.cuda.get_device_name(0)
    peak = CUDABackend(0).peak_flops(torch.bfloat16)
    assert peak == peak_flops_of(name, "bf16")
    print(f"{name}: bf16 peak {peak}")
