"""Ulysses attention for transformers models, registered in transformers' ``AttentionInterface``.

:func:`install` registers one attention function under :data:`NAME` and switches the model to it
(``model.set_attn_implementation``): transformers' source is not patched. The function all-to-alls the
query, key and value from "every head, this rank's slice of the sequence" to "this rank's heads, the whole
sequence", runs the model's own attention implementation (``sdpa``, ``eager`` or a flash kernel) on it with a
causal mask over the whole sequence, and all-to-alls the output back. transformers builds no mask for an
attention name it does not know, so the model's mask is never a local-length one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from torchbay_fsdp.ulysses.collectives import heads_to_sequence, sequence_to_heads

#: the attention implementation name the wrapped models carry
NAME = "torchbay_ulysses"


@dataclass
class _Group:
    group: Any
    size: int
    core: str  # the attention run on the gathered sequence


#: the sp group of this process (one mesh per process: one group), set by :func:`install`
_ACTIVE: dict[str, _Group] = {}


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``(B, H, S/sp, D)`` in, ``(B, S/sp, H, D)`` out."""
    sp = _ACTIVE[NAME]
    q, k, v = (heads_to_sequence(t, sp.group, sp.size) for t in (query, key, value))
    if sp.core == "eager":
        out = _eager(q, k, v, dropout if module.training else 0.0, scaling)
    else:
        from transformers import AttentionInterface

        kwargs.pop("is_causal", None)
        out, _ = AttentionInterface()[sp.core](module, q, k, v, None, dropout=dropout, scaling=scaling,
                                               is_causal=True, **kwargs)
    return sequence_to_heads(out, sp.group, sp.size), None


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scaling: Optional[float]):
    """Causal softmax attention written out (transformers' eager attention is each model's own function)."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:  # grouped-query attention: query head i reads key/value head i // repeat
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def install(model: torch.nn.Module, group: Any, size: int, core: Optional[str] = None) -> str:
    """Register :func:`ulysses_attention` and switch ``model`` to it; the attention it wraps is ``core`` or the
    model's own implementation (``sdpa`` when it has none). Returns the wrapped implementation's name."""
    from transformers import AttentionInterface

    config = model.config
    own = getattr(config, "_attn_implementation", None)
    core = core or (own if own and own != NAME else "sdpa")
    AttentionInterface.register(NAME, ulysses_attention)
    _ACTIVE[NAME] = _Group(group, size, core)
    model.set_attn_implementation(NAME)
    return core
