"""Accelerate's torchao FP8 helpers (``accelerate.utils.ao``), served by this plugin for code that converts a
model itself instead of choosing ``mixed_precision: fp8`` with ``fp8.backend: torchao`` in the config.

``convert_model_to_fp8_ao`` converts every eligible ``nn.Linear`` to torchao's Float8 Linear in place, except the
first and the last (quantizing those destabilises training), as Accelerate's does; ``module_filter_func`` replaces
that choice.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torchbay_fp8 import fp8_gemm_shape


def find_first_last_linear_layers(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The names of the first and the last ``nn.Linear`` of ``model`` in module order (``None`` without one)."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: torch.nn.Module, fqn: str, layers_to_filter: list[str]) -> bool:
    """Whether to convert ``module`` (named ``fqn``): not one of ``layers_to_filter``, and a Linear only when
    both its dimensions are multiples of 16 (FP8 matmuls need them)."""
    if isinstance(module, torch.nn.Linear) and not fp8_gemm_shape(module):
        return False
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """Accelerate's filter that finds the first and last Linear of the module it is handed: torchao hands it one
    layer at a time, so it filters nothing there; :func:`convert_model_to_fp8_ao` finds them on the whole model."""
    return filter_linear_layers(module, fqn, layers_to_filter=list(find_first_last_linear_layers(module)))


def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` is torchao's Float8 Linear."""
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(module, Float8Linear) for module in model.modules())


def convert_model_to_fp8_ao(model: torch.nn.Module, config: Any = None,
                            module_filter_func: Callable[[torch.nn.Module, str], bool] | None = None) -> None:
    """Convert ``model``'s Linears to torchao's Float8 Linear in place, all but the first and the last unless
    ``module_filter_func(module, fqn)`` decides; ``config`` is torchao's ``Float8LinearConfig`` (its default
    when ``None``)."""
    from torchao.float8 import convert_to_float8_training

    if module_filter_func is None:
        module_filter_func = functools.partial(filter_linear_layers,
                                               layers_to_filter=list(find_first_last_linear_layers(model)))
    convert_to_float8_training(model, module_filter_fn=module_filter_func, config=config)
