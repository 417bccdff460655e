"""save_state / load_state beside plain safetensors + torch.save on the same model and AdamW state.

torchbay writes under <dir>.partial, fsyncs every file, records an xxh3-128 checksum per file
in the manifest and publishes with a rename; load verifies every checksum first. The
baseline writes model.safetensors and optimizer.pt with no fsync ("raw"), and once more
with an fsync of both files ("raw+fsync", what durability costs on this disk by itself).
Rounds alternate so that machine noise hits each the same; ratios are medians of rounds.

    python benchmarks/bench_checkpoint.py [--mb 200] [--rounds 5]
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from torchbay import Accelerator


def build(mb: int):
    width = 1024
    layers = max(1, int(mb * 2**20 / 4 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # AdamW state: two tensors per parameter, 2x the model
    return model, optimizer


def raw_save(model, optimizer, directory, sync):
    os.makedirs(directory)
    save_file(model.state_dict(), os.path.join(directory, "model.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
    if sync:
        for name in ("model.safetensors", "optimizer.pt"):
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())


def raw_load(model, optimizer, directory):
    model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")))
    optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200, help="model size; AdamW state is twice that")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first (a VM's page cache "
                        "is slow to write into memory it has never touched)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    acc = Accelerator()
    model, optimizer = build(args.mb)
    model, optimizer = acc.prepare(model, optimizer)
    unverified = Accelerator(config={"checkpoint": {"verify": False}})
    unverified._models, unverified._optimizers = acc._models, acc._optimizers  # the same prepared objects
    work = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=os.environ.get("BENCH_DIR"))
    times = {k: [] for k in ("raw save", "raw+fsync save", "torchbay save", "raw load", "torchbay load", "... verify off")}
    try:
        for r in range(args.warmup + args.rounds):
            raw_dir, synced_dir, ours = (os.path.join(work, n) for n in ("raw", "synced", "ours"))
            for path in (raw_dir, synced_dir):
                shutil.rmtree(path, ignore_errors=True)  # the benchmark's own scratch directories
            cases = [("raw save", lambda: raw_save(model, optimizer, raw_dir, False)),
                     ("raw+fsync save", lambda: raw_save(model, optimizer, synced_dir, True)),
                     ("torchbay save", lambda: acc.save_state(ours))]
            for name, fn in (cases if r % 2 == 0 else cases[::-1]):
                seconds = timed(fn)
                if r >= args.warmup:
                    times[name].append(seconds)
            loads = [("raw load", lambda: raw_load(model, optimizer, raw_dir)),
                     ("torchbay load", lambda: acc.load_state(ours)),
                     ("... verify off", lambda: unverified.load_state(ours))]
            for name, fn in (loads if r % 2 == 0 else loads[::-1]):
                seconds = timed(fn)
                if r >= args.warmup:
                    times[name].append(seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    print(f"model {size:.0f} MiB + AdamW state {2 * size:.0f} MiB, {args.rounds} alternating rounds (median s)")
    print(f"{'case':<18}{'seconds':>9}{'ratio to raw':>14}")
    for name, values in times.items():
        base = times["raw save" if "save" in name else "raw load"]
        ratios = [v / b for v, b in zip(values, base)]
        print(f"{name:<18}{statistics.median(values):>9.3f}{statistics.median(ratios):>14.3f}")


if __name__ == "__main__":
    main()
