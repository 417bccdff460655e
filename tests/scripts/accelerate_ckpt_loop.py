"""A short training loop run on the real Accelerate or on torchbay (same code): ``save`` trains S steps and writes
``accelerator.save_state(DIR)`` then trains on; ``resume`` builds everything again (other initial weights), calls
``accelerator.load_state(DIR)`` and trains the same remaining steps. Rank 0 writes the losses as JSON.

``python accelerate_ckpt_loop.py save|resume DIR RESULT.json [--backend accelerate|torchbay]``
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import torch

S, TOTAL, LR = 4, 10, 0.05


class Counter:
    """A registered object (register_for_checkpointing): custom_checkpoint_0.pkl."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def build(backend: str, seed: int):
    if backend == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import set_seed
    else:
        from torchbay import Accelerator
        from torchbay.utils import set_seed
    acc = Accelerator(cpu=True)
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, loader, sched, counter


def steps(acc, model, opt, loader, sched, counter, first: int, last: int) -> list[float]:
    losses = []
    batches = list(loader)
    for i in range(first, last):
        x, y = batches[i % len(batches)]
        noise = torch.randn(x.shape) * 0.01 + float(np.random.rand()) * 0.01 + random.random() * 0.01
        loss = torch.nn.functional.mse_loss(model(x + noise), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 1
        losses.append(round(acc.reduce(loss.detach(), "mean").item(), 7))
    return losses


def main():
    mode, directory, result = sys.argv[1:4]
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "accelerate"
    if mode == "save":
        acc, model, opt, loader, sched, counter = build(backend, seed=11)
        model.train()
        first = steps(acc, model, opt, loader, sched, counter, 0, S)
        acc.save_state(directory)
        rest = steps(acc, model, opt, loader, sched, counter, S, TOTAL)
        out = {"first": first, "rest": rest, "seen": counter.seen, "lr": sched.get_last_lr()}
    else:
        acc, model, opt, loader, sched, counter = build(backend, seed=999)
        model.train()
        acc.load_state(directory)
        rest = steps(acc, model, opt, loader, sched, counter, S, TOTAL)
        out = {"rest": rest, "seen": counter.seen, "lr": sched.get_last_lr()}
    if acc.is_main_process:
        with open(result, "w") as f:
            json.dump(out, f)
    acc.end_training() if hasattr(acc, "end_training") else None


if __name__ == "__main__":
    main()
