"""Shared pieces of the pipeline-parallel worker scripts: parallel_common's small transformer with
four blocks (two stages per rank for the interleaved schedules), its loss function, and the
single-process reference run."""

from __future__ import annotations

import torch
from parallel_common import DIM, GLOBAL_BATCH, LR, SEQ, VOCAB, Block, TinyGPT, dataset, write_json  # noqa: F401
from torch import nn

BLOCKS, K, S = 4, 3, 2  # blocks, steps, save after step S


class PipeGPT(TinyGPT):
    """parallel_common's model with four blocks."""

    def __init__(self):
        super().__init__(blocks=BLOCKS)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return PipeGPT()


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def reference(steps: int = K, max_norm: float | None = 1.0):
    """One process, the same model, seed and global batches: losses, gradient norms and final weights."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = dataset(steps).tensors[1]
    losses, norms = [], []
    for step in range(steps):
        batch = tokens[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max((a[k] - b[k]).abs().max().item() for k in a)
