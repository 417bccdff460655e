"""Collectives over nested structures of tensors (lists, tuples, dicts), built on a Strategy."""

from __future__ import annotations

from typing import Any, Callable

import torch


def recursively_apply(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: recursively_apply(fn, v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(recursively_apply(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(fn, v) for v in data)
    return data


def gather(strategy, data: Any) -> Any:
    return recursively_apply(strategy.all_gather, data)


def reduce(strategy, data: Any, reduction: str = "sum") -> Any:
    if reduction == "none":
        return data
    return recursively_apply(lambda t: strategy.all_reduce(t, op=reduction), data)


def pad_across_processes(strategy, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if dim >= tensor.ndim:
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        biggest = int(strategy.all_gather(size).max())
        if biggest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = biggest
        out = tensor.new_full(shape, pad_index)
        index = [slice(None)] * tensor.ndim
        index[dim] = slice(biggest - tensor.shape[dim], biggest) if pad_first else slice(0, tensor.shape[dim])
        out[tuple(index)] = tensor
        return out

    return recursively_apply(pad, data)


def truncate(data: Any, length: int) -> Any:
    return recursively_apply(lambda t: t[:length] if t.ndim else t, data)
