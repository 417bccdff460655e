"""Ulysses sequence parallelism (``parallelism.sp_size``) for ``strategy: fsdp``.

The ranks of one ``sp`` group read the same batch and each keeps a contiguous slice of its sequence
(:mod:`.batches`); around attention an all-to-all turns "all heads, my slice of the sequence" into "my
share of the heads, the whole sequence" and back (:mod:`.collectives`, :mod:`.attention`), so attention
itself runs unchanged. transformers models are wrapped through transformers' own attention registry
(``AttentionInterface``); the labels stay whole in the batch and the model's forward takes its slice of them
(:func:`.batches.cut_labels`); the loss becomes the token-weighted mean over the sp group (:mod:`.loss`).
Checks that need no process group are in :mod:`.checks`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from torchbay_fsdp.ulysses.attention import install
from torchbay_fsdp.ulysses.batches import SequenceShardedBatches, cut_labels, local_shift_labels
from torchbay_fsdp.ulysses.checks import check_model
from torchbay_fsdp.ulysses.loss import add_loss_hook, token_mean

__all__ = ["SequenceShardedBatches", "apply_ulysses", "local_shift_labels", "token_mean"]


def apply_ulysses(model: Any, group: Any, size: int, attn_implementation: Optional[str] = None, tp: int = 1) -> str:
    """Check ``model`` (:func:`.checks.check_model`, counting the ``tp`` ranks that split its heads first), switch its
    attention to Ulysses and make its loss the token-weighted mean over the sp group; returns the attention
    implementation run on the gathered sequence."""
    check_model(model, size, tp)
    core = install(model, group, size, attn_implementation)
    model.register_forward_pre_hook(cut_labels(dist.get_rank(group), size), with_kwargs=True)
    add_loss_hook(model, group)
    return core
