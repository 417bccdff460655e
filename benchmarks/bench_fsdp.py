"""FSDP2 vs DDP: peak memory per rank and step time, side by side, 2 processes on CPU (gloo).

    python benchmarks/bench_fsdp.py [--steps 8] [--blocks 8] [--width 1024] [--batch 16]

The model's parameters dominate its memory: ``--blocks`` residual MLP blocks of width
``--width`` (hidden 4x), AdamW. Each strategy runs in its own ``torchrun`` launch; the
parent prints, per strategy and as the fsdp/ddp ratio:

- state MB: bytes of parameters + gradients + optimizer state each rank holds (exact,
  counted from the tensors; local shards for fsdp);
- peak MB: the largest resident set reached during the timed steps, minus the resident
  set before the model was built (Linux VmHWM, reset after ``prepare``);
- step s: median wall time of one training step (forward, backward, optimizer step).

Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (both strategies): glibc then returns
freed large blocks to the OS, so the resident set follows live tensors instead of keeping
the full model built before sharding (and every freed all-gather buffer) resident.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def worker(args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from torch import nn

    from torchbay import Accelerator

    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, blocks, width):
            super().__init__()
            self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))

        def forward(self, x):
            return self.blocks(x)

    extra = {"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}} if args.worker == "fsdp" else {}
    acc = Accelerator(strategy=args.worker, seed=0, config=extra)
    baseline_kb = _rss_kb("VmRSS")
    model = Net(args.blocks, args.width)
    model = acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(acc.process_index)
    x = torch.randn(args.batch, args.width, generator=gen)
    reset = _reset_peak()
    times = []
    for step in range(args.steps):
        acc.wait_for_everyone()
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated: count them in the state
        acc.wait_for_everyone()
        times.append(time.perf_counter() - start)
    peak_kb = _rss_kb("VmHWM")

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    state_bytes = sum(local(p).nbytes for p in model.parameters())
    state_bytes += sum(local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    state_bytes += sum(local(v).nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    row = {"rank": acc.process_index, "params": sum(p.numel() for p in model.parameters()),
           "state_mb": state_bytes / 2**20, "peak_mb": (peak_kb - baseline_kb) / 1024, "peak_reset": reset,
           "step_s": statistics.median(times[2:] if len(times) > 3 else times)}
    rows = acc.strategy.all_gather_object(row)
    if acc.is_main_process:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    acc.end_training()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--worker", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    from torchbay.testing.processes import run_torchrun

    common = ["--steps", str(args.steps), "--blocks", str(args.blocks), "--width", str(args.width),
              "--batch", str(args.batch)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "fsdp"):
            out = os.path.join(tmp, f"{strategy}.json")
            run_torchrun(os.path.abspath(__file__), args.nprocs, ["--worker", strategy, "--out", out, *common],
                         env={"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "1048576")},
                         timeout=900).check()
            with open(out) as f:
                results[strategy] = json.load(f)
    params = results["ddp"][0]["params"]
    print(f"bench_fsdp: {args.blocks} blocks, width {args.width} (hidden {4 * args.width}), {params / 1e6:.1f}M "
          f"params, AdamW, batch {args.batch}/rank, {args.nprocs} processes on CPU (gloo), {args.steps} steps")
    print(f"{'':10}{'state MB/rank':>15}{'peak MB/rank':>15}{'step s':>10}")
    summary = {}
    for strategy, rows in results.items():
        worst = {k: max(r[k] for r in rows) for k in ("state_mb", "peak_mb", "step_s")}
        summary[strategy] = worst
        print(f"{strategy:10}{worst['state_mb']:15.1f}{worst['peak_mb']:15.1f}{worst['step_s']:10.3f}")
    ratio = {k: summary["fsdp"][k] / summary["ddp"][k] for k in summary["ddp"]}
    print(f"{'fsdp/ddp':10}{ratio['state_mb']:15.2f}{ratio['peak_mb']:15.2f}{ratio['step_s']:10.2f}")
    if not all(r["peak_reset"] for rows in results.values() for r in rows):
        print("(peak could not be reset after prepare: it includes building the full model)")
    print(json.dumps({"results": results, "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
