"""Core overhead, side by side in one run: the same training step through the Accelerator
and as a raw PyTorch loop (3 x Linear(256), batch 32, AdamW, 1 thread), plain, with
gradient accumulation 4, and with bf16 autocast; and `import torch` vs `from torchbay import
Accelerator` plus building the plugin registries (with every plugin of this repository installed).

Rounds alternate raw and torchbay so that machine noise hits both; the ratio is the median
over rounds of (torchbay time / raw time).

    python benchmarks/bench_core.py [--steps 300] [--rounds 7]
"""

import argparse
import statistics
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset


WIDTH = 256


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def loader(steps):
    data = TensorDataset(torch.randn(steps * 32, WIDTH), torch.randn(steps * 32, WIDTH))
    return DataLoader(data, batch_size=32, shuffle=True)


def raw_loop(steps, accumulation, bf16):
    model, opt = make()
    dl = loader(steps)
    start = time.perf_counter()
    for i, (x, y) in enumerate(dl):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y) / accumulation
        loss.backward()
        if (i + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - start


def torchbay_loop(steps, accumulation, bf16):
    from torchbay import Accelerator

    acc = Accelerator(gradient_accumulation_steps=accumulation, mixed_precision="bf16" if bf16 else "no")
    model, opt = make()
    model, opt, dl = acc.prepare(model, opt, loader(steps))
    start = time.perf_counter()
    for x, y in dl:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
    elapsed = time.perf_counter() - start
    acc.end_training()
    return elapsed


def import_seconds(statement):
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def import_times(rounds):
    """``import torch`` vs what a user script does first, with every plugin installed:
    ``from torchbay import Accelerator`` and building the plugin registries."""
    ours_statement = ("from torchbay import Accelerator; from torchbay.plugins import get_plugin_manager; "
                      "get_plugin_manager().registries()")
    torch_s, ours_s = [], []
    for i in range(rounds):
        pair = [("torch", "import torch"), ("ours", ours_statement)]
        for name, statement in (pair if i % 2 == 0 else pair[::-1]):
            (torch_s if name == "torch" else ours_s).append(import_seconds(statement))
    return statistics.median(torch_s), statistics.median(ours_s), statistics.median(
        [o / t for o, t in zip(ours_s, torch_s)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'case':<26}{'raw s':>9}{'torchbay s':>12}{'ratio':>8}")
    for name, accumulation, bf16 in [("plain", 1, False), ("grad accumulation 4", 4, False), ("bf16 autocast", 1, True)]:
        raw_loop(20, accumulation, bf16), torchbay_loop(20, accumulation, bf16)  # warm up
        raws, ours, ratios = [], [], []
        for i in range(args.rounds):  # alternate which runs first, so order effects cancel
            if i % 2 == 0:
                r = raw_loop(args.steps, accumulation, bf16)
                t = torchbay_loop(args.steps, accumulation, bf16)
            else:
                t = torchbay_loop(args.steps, accumulation, bf16)
                r = raw_loop(args.steps, accumulation, bf16)
            raws.append(r), ours.append(t), ratios.append(t / r)
        print(f"{name:<26}{statistics.median(raws):>9.3f}{statistics.median(ours):>12.3f}"
              f"{statistics.median(ratios):>8.3f}")
    # wall-clock ratios on a shared VM move by several percent between rounds; torchbay's own
    # cost per step is measured directly on a model so small that nothing else takes time
    global WIDTH
    WIDTH, full_width = 1, WIDTH
    print(f"\n{'own cost per step (width 1)':<26}{'raw us':>9}{'torchbay us':>12}{'+us':>8}")
    for name, accumulation, bf16 in [("plain", 1, False), ("grad accumulation 4", 4, False), ("bf16 autocast", 1, True)]:
        raws, ours = [], []
        for i in range(args.rounds):
            raws.append(raw_loop(args.steps, accumulation, bf16) / args.steps * 1e6)
            ours.append(torchbay_loop(args.steps, accumulation, bf16) / args.steps * 1e6)
        r, t = statistics.median(raws), statistics.median(ours)
        print(f"{name:<26}{r:>9.1f}{t:>12.1f}{t - r:>8.1f}")
    WIDTH = full_width
    torch_s, ours_s, ratio = import_times(args.rounds)
    print(f"{'import (torch vs torchbay)':<26}{torch_s:>9.3f}{ours_s:>12.3f}{ratio:>8.3f}")


if __name__ == "__main__":
    main()
