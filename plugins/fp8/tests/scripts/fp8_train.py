"""Worker for plugins/fp8/tests/test_fp8.py: a small regression trained through the public API, three ways
in one process, for each strategy of ``--strategies`` (comma-separated: ``single``, or
``ddp,fsdp`` under torchrun, sharing one process group):

1. ``bf16``: the reference run, ``--steps`` optimizer steps;
2. ``fp8``: torchao FP8 (emulated on CPU) for ``--steps`` steps, ``save_state`` after ``--save-at``;
3. ``resume``: a fresh Accelerator, model, optimizer and loader, ``load_state`` and finish.

Writes ``<out>.<strategy>.rank<r>.json`` with each run's losses, final full-data loss, the
converted modules and a digest of the final weights. ``main(argv)`` is importable so that the
single-process case can run inside the test process.
"""

import argparse
import hashlib
import json
import logging

import torch
from torch.utils.data import DataLoader, TensorDataset

from torchbay import Accelerator

HIDDEN = 64
N = 512


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--strategies", default="single")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--save-at", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--recipe", default="tensorwise")
    return p.parse_args(argv)


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=gen)
    y = torch.sin(x @ torch.randn(16, 1, generator=gen) / 4) + 0.05 * torch.randn(N, 1, generator=gen)
    return x, y


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


def run(args, strategy, mixed_precision, ckpt, save_at=None, resume=False):
    fp8 = {"backend": "torchao", "recipe": args.recipe, "engine_options": {"emulate": True}}
    acc = Accelerator(mixed_precision=mixed_precision, strategy=strategy, seed=0,
                      config={"fp8": fp8} if mixed_precision == "fp8" else None)
    x, y = data()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    if resume:
        acc.load_state(ckpt)
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
                acc.save_state(ckpt)
            if progress.steps == args.steps:
                break
        if progress.steps == args.steps:
            break
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x).float(), y).item()
    precision = acc.precision
    out = {"losses": losses, "final": final, "digest": digest(acc, model), "precision": precision.describe(),
           "converted": getattr(precision, "converted", None), "strategy": acc.strategy.name,
           "world": acc.num_processes, "rank": acc.process_index,
           "fsdp_float8_weights": precision.fsdp_float8_weights() if mixed_precision == "fp8" else [],
           "scale_precomputations": getattr(precision, "scale_precomputations", 0),
           "modules": sorted({type(m).__name__ for m in acc.unwrap_model(model).modules()})}
    return acc, out


def main(argv=None):
    args = parse(argv)
    last = None
    for strategy in args.strategies.split(","):
        ckpt = f"{args.ckpt}.{strategy}"
        _, bf16 = run(args, strategy, "bf16", ckpt)
        with torch.no_grad():
            x, y = data()
            initial = torch.nn.functional.mse_loss(build_model()(x), y).item()
        acc, fp8 = run(args, strategy, "fp8", ckpt, save_at=args.save_at)
        last, resumed = run(args, strategy, "fp8", ckpt, resume=True)
        with open(f"{args.out}.{strategy}.rank{acc.process_index}.json", "w") as f:
            json.dump({"initial": initial, "bf16": bf16, "fp8": fp8, "resume": resumed}, f)
    if last is not None and last.num_processes > 1:
        last.end_training()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
