"""MX block-scaled training Linears (``fp8.recipe: mxfp8``, ``mixed_precision: fp4`` with ``mxfp4``) on torchao.

:class:`MXTrainingLinear` is an ``nn.Linear`` whose three GEMMs (forward, grad-input, grad-weight) run on
tensors quantized to an MX format in blocks of 32 elements along the reduction dimension, each block with a
power-of-two scale (E8M0): FP8 E4M3 elements for ``mxfp8``, FP4 E2M1 for ``mxfp4``. It is torchao's
``mx_mm`` autograd function (torchao.prototype.moe_training.mxfp8_linear); torchbay only chooses its
arguments. Conversion changes the class of the user's own module in place, so its parameters (and an
optimizer built before ``prepare``) stay the same objects, and the state_dict keys are those of ``nn.Linear``.

Emulated (``fp8.emulate: true``): quantization and dequantization in plain torch, the GEMM in high
precision: the numerics of the format, on any device. The gradient of the weight reduces over the tokens,
so they are padded with zero rows to a multiple of 32 (zeros add nothing to it). Native: MX GEMMs need an
NVIDIA Blackwell GPU (compute capability 10.0+). Under an outer bf16 autocast the operands are cast to bf16
first and the function runs with autocast off (torchao's casts want one dtype in and out).
"""

from __future__ import annotations

import torch

#: recipe -> (element dtype name in torch, what it is)
MX_RECIPES = {"mxfp8": ("float8_e4m3fn", "FP8 E4M3 elements"), "mxfp4": ("float4_e2m1fn_x2", "FP4 E2M1 elements")}
BLOCK_SIZE = 32


def native_reason(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why MX GEMMs cannot run natively here, or ``None``."""
    if device_type != "cuda":
        return f"device type '{device_type}' has no MX block-scaled GEMM (torchao runs them on NVIDIA Blackwell)"
    if capability is None or capability < (10, 0):
        cap = f"{capability[0]}.{capability[1]}" if capability else "unknown"
        return f"MX block-scaled GEMMs need an NVIDIA Blackwell GPU (compute capability 10.0+); this one is {cap}"
    return None


class MXTrainingLinear(torch.nn.Linear):
    """``nn.Linear`` training through MX-quantized GEMMs (see the module docstring)."""

    mx_recipe: str = "mxfp8"
    mx_emulate: bool = True

    @classmethod
    def convert(cls, module: torch.nn.Linear, recipe: str, emulate: bool) -> "MXTrainingLinear":
        """Make ``module`` (exactly an ``nn.Linear``) one of these, in place; returns it."""
        module.__class__ = cls
        module.mx_recipe = recipe
        module.mx_emulate = emulate
        return module

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.mx_recipe}{', emulated' if self.mx_emulate else ''}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm
        from torchao.prototype.mx_formats.config import (
            MXFP8Dim0CastKernelChoice,
            MXFP8Dim1CastKernelChoice,
            ScaleCalculationMode,
        )
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        elem = getattr(torch, MX_RECIPES[self.mx_recipe][0])
        if self.mx_emulate:
            kernels = (KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH)
        else:
            kernels = (KernelPreference.AUTO, MXFP8Dim0CastKernelChoice.TRITON, MXFP8Dim1CastKernelChoice.CUDA)
        rows = x.reshape(-1, x.shape[-1])
        pad = -rows.shape[0] % BLOCK_SIZE  # grad-weight reduces over the tokens: blocks of 32 need 32k of them
        if pad:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
        with torch.autocast(device_type, enabled=False):
            out = mx_mm.apply(rows.to(dtype), self.weight.to(dtype), elem, elem, elem, BLOCK_SIZE, *kernels,
                              ScaleCalculationMode.RCEIL, False)
            if pad:
                out = out[:-pad]
            if self.bias is not None:
                out = out + self.bias.to(dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def convert_mx(model: torch.nn.Module, names: list[str], recipe: str, emulate: bool) -> None:
    """Convert the ``nn.Linear`` modules ``names`` of ``model`` to :class:`MXTrainingLinear` in place."""
    for name in names:
        MXTrainingLinear.convert(model.get_submodule(name), recipe, emulate)


def quantize_dequantize(tensor: torch.Tensor, recipe: str) -> torch.Tensor:
    """``tensor`` (2-D, last dimension a multiple of 32) through the recipe's MX format and back: the rounding
    a GEMM operand gets (the numerics benchmark's quantization error)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    elem = getattr(torch, MX_RECIPES[recipe][0])
    mx = MXTensor.to_mx(tensor.contiguous(), elem, BLOCK_SIZE, ScaleCalculationMode.RCEIL, KernelPreference.EMULATED)
    return mx.dequantize(tensor.dtype)
