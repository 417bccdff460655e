"""The loss under sequence parallelism: the token-weighted mean over the sp group.

Each rank's model returns the mean over its own slice's labelled tokens; the loss of the whole sequence is
``sum_i mean_i * n_i / sum_i n_i``. Its sum over the group is differentiable (its backward sums the gradient
over the group too), so every rank back-propagates ``sp_size`` times its share and FSDP's mean over
``dp_shard x sp`` leaves the gradient of the whole sequence's loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchbay_fsdp.ulysses.batches import IGNORE_INDEX
from torchbay_fsdp.ulysses.collectives import sum_over_group


def token_mean(loss_sum: torch.Tensor, tokens: torch.Tensor, group: Any) -> torch.Tensor:
    """``sum over the group of loss_sum / sum over the group of tokens`` (for a loss computed by hand)."""
    total = tokens.detach().to(loss_sum.dtype).clone()
    dist.all_reduce(total, group=group)
    return sum_over_group(loss_sum, group) / total.clamp(min=1)


def add_loss_hook(model: torch.nn.Module, group: Any) -> Any:
    """Replace the ``loss`` a model computes from ``shift_labels`` by the token-weighted mean over the group."""

    def hook(module, args, kwargs, output):
        loss = getattr(output, "loss", None)
        labels = kwargs.get("shift_labels")
        if loss is None or not isinstance(labels, torch.Tensor):
            return output
        tokens = (labels != IGNORE_INDEX).sum()
        given = kwargs.get("num_items_in_batch")
        if given is not None:  # the model divided by the count it was given
            tokens = torch.as_tensor(given, device=loss.device)
        output.loss = token_mean(loss.nan_to_num(0.0) * tokens.to(loss.dtype), tokens, group)  # 0/0 on all-padding
        return output

    return model.register_forward_hook(hook, with_kwargs=True)
