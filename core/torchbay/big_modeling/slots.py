"""A model's tensors as slots: one slot per tensor object, with every name it has (several when tied).

Both users of big-model placement work on slots: ``loading`` puts each checkpoint value into its
slot, ``dispatch`` decides each slot's device and gives the hooks the slots they lend. Replacing a
slot's tensor replaces it under all of its names at once, so a tie stays one tensor.
"""

from __future__ import annotations

import torch
from torch import nn


class Slot:
    """One tensor object of a model and every name it has (several when tied)."""

    __slots__ = ("names", "tensor", "is_param")

    def __init__(self, name: str, tensor: torch.Tensor, is_param: bool):
        self.names, self.tensor, self.is_param = [name], tensor, is_param

    def assign(self, model: nn.Module, value: torch.Tensor) -> None:
        """Put ``value`` under every name (a parameter stays one parameter object)."""
        if self.is_param and not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=self.tensor.requires_grad and value.is_floating_point())
        for name in self.names:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            (module._parameters if self.is_param else module._buffers)[leaf] = value
        self.tensor = value

    def value(self, state_dict: dict | None) -> torch.Tensor | None:
        """Its value from ``state_dict`` (under any of its names), else its own tensor; ``None`` when
        neither gives one (the tensor is on the meta device)."""
        if state_dict is not None:
            for name in self.names:
                if name in state_dict:
                    return state_dict[name]
        return None if self.tensor.device.type == "meta" else self.tensor


def model_slots(model: nn.Module) -> tuple[list[Slot], list[Slot]]:
    """(persistent slots, non-persistent buffers), ties grouped, in definition order."""
    by_id: dict[int, Slot] = {}
    transient: list[Slot] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in by_id:
            by_id[id(param)].names.append(name)
        else:
            by_id[id(param)] = Slot(name, param, True)
    for name, buf in model.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        if leaf in model.get_submodule(owner)._non_persistent_buffers_set:
            transient.append(Slot(name, buf, False))
        elif id(buf) in by_id:
            by_id[id(buf)].names.append(name)
        else:
            by_id[id(buf)] = Slot(name, buf, False)
    return list(by_id.values()), transient


def few(names: list[str], n: int = 12) -> str:
    """The first ``n`` names, and how many more there are."""
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


__all__ = ["Slot", "few", "model_slots"]
