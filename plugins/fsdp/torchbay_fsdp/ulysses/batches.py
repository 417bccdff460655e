"""The data loader's share of the sequence on each rank of an sp group, and the labels' share in the model.

Every rank of one sp group reads the same batch (sp is not a data-parallel dimension); the loader keeps the
rank's contiguous slice of every ``(batch, sequence, ...)`` tensor but the labels. ``position_ids`` are computed
over the whole sequence before slicing (0..S-1 unless the batch has its own), so rotary embeddings see global
positions. ``labels`` (and ``shift_labels``, when a collator gives them) stay whole: whoever counts the labelled
tokens of a batch (transformers' Trainer, for ``num_items_in_batch``) counts the whole sequence, as on the ranks of
a tensor-parallel group, and :func:`cut_labels`, a forward pre-hook of the wrapped model, gives the model this
rank's slice of the shifted labels (the label of each position's next token, -100 at the end) as ``shift_labels``.

The loader's length: transformers' Trainer multiplies the length of the training loader it prepared by
``sp_size`` (Accelerate's DeepSpeed adapter, applied after the model is prepared, runs each rank's batch on the
sp group in turn); torchbay's sp group shares one batch instead. Until the model is wrapped
:meth:`SequenceShardedBatches.loop_length` is the loader's batches divided by ``sp_size`` (rounded down: with a
remainder, a loop counting that way leaves the last batches of an epoch out), then the batches themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from torchbay.errors import ConfigError

IGNORE_INDEX = -100
#: keys kept whole by the loader and cut by the model's pre-hook
LABELS = ("labels", "shift_labels")


def shard_batch(batch: Any, rank: int, size: int) -> dict[str, Any]:
    """This rank's slice of one batch (a mapping with ``input_ids`` or ``inputs_embeds``); labels kept whole."""
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
    piece = length // size
    for key, value in out.items():
        if key not in LABELS and isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[:2] == (b, length):
            out[key] = value[:, rank * piece:(rank + 1) * piece].contiguous()
    return out


def local_shift_labels(labels: torch.Tensor, rank: int, size: int, shifted: bool = False) -> torch.Tensor:
    """This rank's slice of the shifted labels of whole ``labels`` (already shifted when ``shifted``)."""
    if not shifted:
        labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    piece = labels.shape[1] // size
    return labels[:, rank * piece:(rank + 1) * piece].contiguous()


def cut_labels(rank: int, size: int) -> Callable:
    """A forward pre-hook (with kwargs) giving the model this rank's ``shift_labels`` from the whole labels."""

    def hook(module, args, kwargs):
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if not isinstance(tokens, torch.Tensor):
            return None
        local = tokens.shape[1]
        for key in ("shift_labels", "labels"):  # a collator's own shift_labels first
            whole = kwargs.get(key)
            if isinstance(whole, torch.Tensor) and whole.ndim >= 2 and whole.shape[1] == local * size:
                kwargs = {**kwargs, "shift_labels": local_shift_labels(whole, rank, size, key == "shift_labels")}
                return args, kwargs
        return None  # labels already this rank's (a loop of its own), or none

    return hook


class SequenceShardedBatches:
    """An iterable of batches (a prepared data loader's) whose every batch is cut to this rank's slice.

    ``model_ready`` says whether the strategy has wrapped a model yet (see the module's note on the length)."""

    def __init__(self, batches: Any, rank: int, size: int, model_ready: Callable[[], bool] = lambda: True):
        self.batches, self.rank, self.size, self.model_ready = batches, rank, size, model_ready

    def __iter__(self):
        for batch in self.batches:
            yield shard_batch(batch, self.rank, self.size)

    def __len__(self) -> int:
        return len(self.batches)

    def loop_length(self) -> int:
        """How many batches a loop over the prepared loader counts on (its ``len``)."""
        return len(self.batches) if self.model_ready() else len(self.batches) // self.size

    def __getattr__(self, name: str) -> Any:  # the inner loader's attributes (sampler, dataset...)
        if name in ("batches", "rank", "size", "model_ready"):
            raise AttributeError(name)
        return getattr(self.batches, name)
