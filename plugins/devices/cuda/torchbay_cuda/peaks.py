"""The published peak math rates of the GPUs this plugin knows, by device identity (``DeviceBackend.peak_flops``).

Figures are TFLOP/s, dense (without 2:4 structured sparsity: the datasheets' "with sparsity" figures halved), for
the board the device name identifies. A device the table cannot identify exactly (an ``H100`` whose name says
neither SXM/HBM3, PCIe nor NVL; an unlisted GPU) has no figure: ``peak_flops`` answers ``None`` and telemetry
logs no MFU, never a guess. ``fp32`` is the non-tensor-core FP32 rate (matrix-core FP32 on AMD Instinct, which is
what FP32 GEMMs use there); ``tf32`` the tensor-core TF32 rate.

Sources (vendor datasheets):

- A100: NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM and PCIe
  share the figures: FP32 19.5, TF32 156, BF16/FP16 312.
- H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet (h100-datasheet, 2023): SXM FP32 67, TF32 989, BF16/
  FP16 1979, FP8 3958 with sparsity; PCIe FP32 51, TF32 756, BF16/FP16 1513, FP8 3026; NVL FP32 60, TF32 835, BF16/
  FP16 1671, FP8 3341 (with sparsity; halved here). GH200's GPU is an H100 SXM-class part (GH200 datasheet).
- H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet (2024): the same as H100 SXM / H100 NVL.
- B200: NVIDIA HGX B200 / DGX B200 datasheet (per GPU: FP4 18 PF, FP8 9 PF, BF16/FP16 4.5 PF, TF32 2.2 PF with
  sparsity; FP32 75 TF).
- MI300X / MI325X: AMD Instinct MI300X and MI325X datasheets: FP32 matrix 163.4, TF32 653.7, BF16/FP16 1307.4,
  FP8 2614.9 (dense figures as AMD states them).
- MI250X: AMD Instinct MI250X datasheet: FP32 matrix 95.7, BF16/FP16 383.
"""

from __future__ import annotations

import re

#: (pattern on the device name, product, {key: dense TFLOP/s}); the first match wins, so the specific comes first
_H100_SXM = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
_H100_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}
_MI300 = {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}
PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (r"\bA100\b", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"\bH100\b.*\bNVL\b", "H100 NVL", _H100_NVL),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0}),
    (r"\bH100\b.*(\bSXM|\bHBM3\b)", "H100 SXM", _H100_SXM),
    (r"\bGH200\b", "GH200", _H100_SXM),
    (r"\bH200\b.*\bNVL\b", "H200 NVL", _H100_NVL),
    (r"\bH200\b", "H200 SXM", _H100_SXM),
    (r"\bB200\b", "B200", {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0,
                           "fp4": 9000.0}),
    (r"\bMI300X\b", "MI300X", _MI300),
    (r"\bMI325X\b", "MI325X", _MI300),
    (r"\bMI250X\b", "MI250X", {"fp32": 95.7, "bf16": 383.0, "fp16": 383.0}),
]


def identify(device_name: str) -> tuple[str, dict[str, float]] | None:
    """``(product, {key: TFLOP/s})`` for a device name (``torch.cuda.get_device_name``), ``None`` when unknown."""
    for pattern, product, figures in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return product, figures
    return None


def peak_flops_of(device_name: str, key: str | None) -> float | None:
    """FLOP/s of ``device_name`` for the math ``key`` (``"bf16"``...), ``None`` when either is unknown."""
    found = identify(device_name)
    if found is None or key is None or key not in found[1]:
        return None
    return found[1][key] * 1e12
