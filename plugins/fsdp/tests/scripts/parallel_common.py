"""Shared pieces of the N-D parallel worker scripts: a small transformer, its tensor-parallel
plan, deterministic global batches, and a single-process reference run."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

VOCAB, DIM, HEADS, SEQ, GLOBAL_BATCH, BLOCKS = 32, 16, 4, 6, 8, 2
K, S, LR = 4, 2, 1e-2  # steps, save after step S

#: colwise q/k/v and up, rowwise o and down: the usual Megatron plan; embedding, norms and head stay whole
PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        # a key bias gets a gradient that is 0 in exact arithmetic (softmax ignores it) and ~1e-9 of
        # rounding noise in practice, which Adam's normalisation turns into updates of ~lr: left out
        self.k = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under tensor parallel each rank holds HEADS / tp_size of them
        q, k, v = (f(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, blocks: int = BLOCKS):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class EveryStyleNet(nn.Module):
    """A model written for sequence parallelism, to run the styles PLAN does not use.

    A plain-tensor model cannot take them: ``sequence_parallel`` wants sequence-sharded
    activations and ``local_*`` hand the next module a DTensor. Here the embedding's output goes
    through a colwise_rep/rowwise_rep MLP (plain tensors, whole), ``to_seq`` splits the sequence
    over the tp ranks (a torch ParallelStyle object in the plan, as torchtitan shards after its
    embedding), the norm runs on the sequence shards, ``up``/``down`` keep DTensors, and ``head``
    takes the replicated DTensor and returns a plain tensor.
    """

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pre_up, self.pre_down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.to_seq = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        x = x + self.pre_down(nn.functional.gelu(self.pre_up(x)))
        h = self.norm(self.to_seq(x))
        return self.head(self.down(nn.functional.gelu(self.up(h))))


def every_style_plan() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return {"pre_up": "colwise_rep", "pre_down": "rowwise_rep",
            "to_seq": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
            "norm": "sequence_parallel", "up": "local_colwise", "down": "local_rowwise", "head": "replicate"}


def make_model(seed: int = 0, every_style: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return EveryStyleNet() if every_style else TinyGPT()


def dataset(steps: int = K) -> torch.utils.data.TensorDataset:
    """``steps`` global batches of GLOBAL_BATCH sequences, in order; each sample carries its index."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (steps * GLOBAL_BATCH, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(torch.arange(steps * GLOBAL_BATCH), tokens)


def loss_of(model, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def reference(every_style: bool = False):
    """Single process: the same model, seed and global batches; losses and final weights."""
    model = make_model(every_style=every_style)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = dataset().tensors[1]
    losses = []
    for step in range(K):
        loss = loss_of(model, tokens[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_state(acc, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in acc.get_state_dict(model).items()}


def max_diff(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def local_param_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def out_dir() -> str:
    return sys.argv[sys.argv.index("--out") + 1]


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
