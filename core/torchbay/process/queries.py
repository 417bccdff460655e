"""Which process runs what (Accelerate's process API), written once for ``Accelerator`` and ``PartialState``.

:class:`ProcessQueries` needs ``process_index``, ``local_process_index``, ``num_processes``, ``device`` and
``wait_for_everyone()`` from the class it is mixed into, and gives the rest: ``is_main_process``...,
``main_process_first``, ``split_between_processes``, the ``on_*_process`` decorators and ``print``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any, Callable

import torch

from torchbay.errors import TorchbayError


class ProcessQueries:
    """Accelerate's process API over the five members the class it is mixed into has (declared here)."""

    process_index: int
    local_process_index: int
    num_processes: int
    device: torch.device
    wait_for_everyone: Callable[[], None]

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @contextlib.contextmanager
    def _goes_first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def main_process_first(self):
        return self._goes_first(self.is_main_process)

    def local_main_process_first(self):
        return self._goes_first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """Give each process its contiguous share of a list, tuple, tensor, dict of those, or datasets.Dataset."""
        yield split_between(inputs, self.num_processes, self.process_index, apply_padding, self.device)

    def on_main_process(self, function: Callable | None = None):
        return only_if(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: Callable | None = None):
        return only_if(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: Callable | None = None):
        return only_if(lambda: self.is_last_process, function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        if process_index is None:
            raise TorchbayError("on_process needs process_index: @on_process(process_index=1)")
        return only_if(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None):
        if local_process_index is None:
            raise TorchbayError("on_local_process needs local_process_index: @on_local_process(local_process_index=1)")
        return only_if(lambda: self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)


def split_between(inputs: Any, num: int, index: int, pad: bool, device: Any = None) -> Any:
    """This process's contiguous share of ``inputs`` (Accelerate's ``split_between_processes``)."""
    if num == 1:
        return inputs
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise TorchbayError("split_between_processes: every value of the dict must have the same length")
        length = lengths.pop() if lengths else 0
    else:
        length = len(inputs)
    per, extra = divmod(length, num)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    width = per + (1 if extra else 0)

    def one(values: Any) -> Any:
        if isinstance(values, (list, tuple, torch.Tensor)):
            part = values[start:end]
            if pad and len(part) < width and length:
                fill = width - len(part)
                if isinstance(part, torch.Tensor):
                    part = torch.cat([part, values[-1:].expand(fill, *values.shape[1:])])
                else:
                    part = part + type(values)([values[-1]] * fill)
            return part
        if isinstance(values, Mapping):
            return type(values)({k: one(v) for k, v in values.items()})
        if hasattr(values, "select") and hasattr(values, "__len__"):  # datasets.Dataset
            indices = list(range(min(start, len(values)), min(end, len(values))))
            if pad:
                indices += [len(values) - 1] * (width - len(indices))
            return values.select(indices)
        return values

    return one(inputs)


def only_if(condition: Callable[[], bool], function: Callable | None = None):
    """Run ``function`` (or, with no function, the decorated one) only where ``condition()`` holds; else ``None``."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs) if condition() else None
        return wrapper
    return decorate if function is None else decorate(function)
