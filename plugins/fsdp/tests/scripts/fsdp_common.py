"""Shared pieces of the fsdp worker scripts: a small block model and deterministic data."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

IN, WIDTH, OUT, GLOBAL_BATCH = 8, 16, 4, 8


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, OUT)
        # not in any state dict: cpu_ram_efficient_loading must still give it to every rank
        self.register_buffer("out_scale", torch.full((OUT,), 0.5), persistent=False)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.out_scale


def make_model(seed: int = 0, meta: bool = False) -> Net:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return Net()
    return Net()


def global_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    return x, y


def local_batch(index: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(index)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def full_state(acc, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in acc.get_state_dict(model).items()}


def max_diff(a: dict, b: dict) -> float:
    if set(a) != set(b):
        return float("inf")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def out_dir() -> str:
    return sys.argv[sys.argv.index("--out") + 1]
