"""Worker for tests/test_fp8.py: a small regression trained through the public API, three ways
in one process (single, DDP or FSDP2, whatever the launch and --strategy say):

1. ``bf16``: the reference run, ``--steps`` optimizer steps;
2. ``fp8``: torchao FP8 (emulated on CPU) for ``--steps`` steps, ``save_state`` after ``--save-at``;
3. ``resume``: a fresh Accelerator, model, optimizer and loader, ``load_state`` and finish.

Writes ``<out>.rank<r>.json`` with each run's losses, final full-data loss, the converted
modules and a digest of the final weights.
"""

import argparse
import hashlib
import json
import logging

import torch
from torch.utils.data import DataLoader, TensorDataset

from torchbay import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--strategy", default="auto")
p.add_argument("--steps", type=int, default=80)
p.add_argument("--save-at", type=int, default=50)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--ckpt", required=True)
p.add_argument("--out", required=True)
p.add_argument("--recipe", default="tensorwise")
args = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

FP8 = {"backend": "torchao", "recipe": args.recipe, "engine_options": {"emulate": True}}
HIDDEN = 64
N = 512
gen = torch.Generator().manual_seed(0)
X = torch.randn(N, 16, generator=gen)
Y = torch.sin(X @ torch.randn(16, 1, generator=gen) / 4) + 0.05 * torch.randn(N, 1, generator=gen)


def build_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, 1))


class Progress:
    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def digest(acc, model):
    state = acc.get_state_dict(model)
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(mixed_precision, save_at=None, resume=False):
    acc = Accelerator(mixed_precision=mixed_precision, strategy=args.strategy, seed=0,
                      config={"fp8": FP8} if mixed_precision == "fp8" else None)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(X, Y), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    if resume:
        acc.load_state(args.ckpt)
    losses = []
    start_epoch, skip = divmod(progress.steps, len(loader))
    for epoch in range(start_epoch, 1000):
        epoch_loader = acc.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for xb, yb in epoch_loader:
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())
            progress.steps += 1
            if save_at is not None and progress.steps == save_at:
                acc.save_state(args.ckpt)
            if progress.steps == args.steps:
                break
        if progress.steps == args.steps:
            break
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(X).float(), Y).item()
    out = {"losses": losses, "final": final, "digest": digest(acc, model), "precision": acc.precision.describe(),
           "converted": getattr(acc.precision, "converted", None), "strategy": acc.strategy.name,
           "world": acc.num_processes, "rank": acc.process_index,
           "fsdp_float8_weights": acc.precision.fsdp_float8_weights() if mixed_precision == "fp8" else [],
           "scale_precomputations": getattr(acc.precision, "scale_precomputations", 0),
           "modules": sorted({type(m).__name__ for m in acc.unwrap_model(model).modules()})}
    return acc, out


acc_bf16, bf16 = run("bf16")
with torch.no_grad():
    initial = torch.nn.functional.mse_loss(build_model()(X), Y).item()
acc_fp8, fp8 = run("fp8", save_at=args.save_at)
acc_resume, resumed = run("fp8", resume=True)
with open(f"{args.out}.rank{acc_fp8.process_index}.json", "w") as f:
    json.dump({"initial": initial, "bf16": bf16, "fp8": fp8, "resume": resumed}, f)
acc_resume.end_training()
