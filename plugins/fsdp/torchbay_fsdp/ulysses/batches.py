"""The data loader's share of the sequence on each rank of an sp group.

Every rank of one sp group reads the same batch (sp is not a data-parallel dimension); this keeps the
rank's contiguous slice of every ``(batch, sequence, ...)`` tensor. Before slicing, what needs the whole
sequence is computed: ``position_ids`` (0..S-1 unless the batch has its own) and ``shift_labels`` (the
labels moved one to the left, -100 at the end: the label of each position's next token, as transformers'
causal-LM loss takes them), so that rotary embeddings and the loss see global positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchbay.errors import ConfigError

IGNORE_INDEX = -100


def shard_batch(batch: Any, rank: int, size: int) -> dict[str, Any]:
    """This rank's slice of one batch (a mapping with ``input_ids`` or ``inputs_embeds``)."""
    if not isinstance(batch, Mapping):
        raise ConfigError(f"parallelism.sp_size {size}: the data loader yields {type(batch).__name__}, but sequence "
                          f"parallelism shards batches that are mappings with input_ids (and labels), as "
                          f"transformers' collators give them; yield a dict")
    tokens = batch.get("input_ids", batch.get("inputs_embeds"))
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        raise ConfigError(f"parallelism.sp_size {size}: a batch has no input_ids / inputs_embeds tensor of shape "
                          f"(batch, sequence) to shard; give the model's inputs under those names")
    b, length = tokens.shape[:2]
    if length % size:
        raise ConfigError(f"parallelism.sp_size {size}: a batch's sequence length {length} is not divisible by "
                          f"sp_size {size}; pad every batch to a multiple of {size} (e.g. the collator's "
                          f"pad_to_multiple_of={size}, with labels -100 on the padding)")
    out = dict(batch)
    mask = out.pop("attention_mask", None)
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ConfigError(f"parallelism.sp_size {size}: a batch's attention_mask masks some tokens; sequence "
                          f"parallelism runs causal attention over the whole sequence, so pad on the right with "
                          f"labels -100 and no attention_mask, or pack sequences")
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(length, device=tokens.device).expand(b, length)
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor) and out.get("shift_labels") is None:
        out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    piece = length // size
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[:2] == (b, length):
            out[key] = value[:, rank * piece:(rank + 1) * piece].contiguous()
    return out


class SequenceShardedBatches:
    """An iterable of batches (a prepared data loader's) whose every batch is cut to this rank's slice."""

    def __init__(self, batches: Any, rank: int, size: int):
        self.batches, self.rank, self.size = batches, rank, size

    def __iter__(self):
        for batch in self.batches:
            yield shard_batch(batch, self.rank, self.size)

    def __len__(self) -> int:
        return len(self.batches)

    def __getattr__(self, name: str) -> Any:  # the inner loader's attributes (sampler, dataset...)
        if name in ("batches", "rank", "size"):
            raise AttributeError(name)
        return getattr(self.batches, name)
