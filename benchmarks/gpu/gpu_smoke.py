"""One process on one accelerator: every torchbay path that needs a GPU, checked and timed.

    python benchmarks/gpu/gpu_smoke.py                 # the best installed device (cuda on a GPU)
    python benchmarks/gpu/gpu_smoke.py --device cpu    # the same flow on the CPU (a dry run of this script)

For each case the same model, weights and batches go through a raw PyTorch loop and through
torchbay; the table shows whether the losses agree, and the step time of each (median of the
timed steps, the device synchronised around each step) with their ratio. Cases:

- ``fp32`` and ``bf16`` (raw: ``torch.autocast``) on the selected device (strategy single);
- ``fp8:torchao`` against the bf16 raw loop, where torchbay-fp8-torchao is installed and the
  device has FP8 matmuls (compute capability 8.9 or newer);
- ``fsdp`` (FSDP2 on a one-rank mesh, bf16) and ``deepspeed`` (ZeRO-2, bf16) where their
  plugins and libraries are installed.

A case that cannot run says why in its row; the script fails (exit 1) only when a case that
ran gave a loss that disagrees with its raw loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")

#: loss agreement with the raw loop: fp32 exact up to kernel order; bf16/fp8 within their rounding
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp8:torchao": 1e-1, "fsdp": 2e-2, "deepspeed": 2e-2}


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


def batches(n: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 16, generator=g)) for _ in range(n)]


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def raw_loop(args, device: torch.device, bf16: bool) -> tuple[list[float], list[float]]:
    model = make_model(args.width, args.depth).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for i, (x, y) in enumerate(batches(args.steps + args.warmup, args.batch, args.width)):
        x, y = x.to(device), y.to(device)
        synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def torchbay_loop(args, case: str) -> tuple[list[float], list[float]]:
    from torchbay import Accelerator

    kwargs: dict = {"mixed_precision": "no" if case == "fp32" else "bf16"}
    if case == "fp8:torchao":
        kwargs = {"mixed_precision": "fp8", "config": {"fp8": {"backend": "torchao"}}}
    elif case == "fsdp":
        kwargs["strategy"] = "fsdp"
    elif case == "deepspeed":
        kwargs["strategy"] = "deepspeed"
        kwargs["config"] = {"deepspeed": {"zero_stage": 2, "train_micro_batch_size_per_gpu": args.batch}}
    if args.device:
        kwargs["device"] = args.device
    acc = Accelerator(**kwargs)
    try:
        model = make_model(args.width, args.depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        # DeepSpeed's bf16 converts the module itself and casts no input (as under Accelerate):
        # a float input must come in the module's dtype
        in_dtype = next(acc.unwrap_model(model).parameters()).dtype if case == "deepspeed" else torch.float32
        losses, times = [], []
        for i, (x, y) in enumerate(batches(args.steps + args.warmup, args.batch, args.width)):
            x, y = x.to(acc.device, in_dtype), y.to(acc.device)
            synchronize(acc.device)
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            synchronize(acc.device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        return losses, times
    finally:
        acc.end_training()


def why_not(case: str, device_name: str) -> str | None:
    """Why ``case`` cannot run here, else None."""
    from torchbay.plugins import get_plugin_manager

    registries = get_plugin_manager().registries()
    if case == "fp8:torchao":
        cls = registries["precisions"].get("fp8:torchao")
        if cls is None:
            return "torchbay-fp8-torchao is not installed"
        if device_name == "cpu" or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            return "no FP8 matmuls on this device (needs compute capability 8.9+)"
        return cls.unavailable_reason(registries["devices"].get(device_name))
    if case in ("fsdp", "deepspeed"):
        if case not in registries["strategies"]:
            return f"torchbay-{case} is not installed"
        if case == "deepspeed":
            try:
                import deepspeed  # noqa: F401
            except ImportError as exc:
                return f"deepspeed cannot be imported ({exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="torchbay device name (default: the best installed)")
    parser.add_argument("--width", type=int, default=None, help="hidden width (GPU default 4096, CPU 256)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="rows per step (GPU default 8192, CPU 64)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)

    from torchbay import Accelerator

    probe = Accelerator(**({"device": args.device} if args.device else {}))
    device, device_name = probe.device, probe.device_backend.name
    probe.end_training()
    gpu = device.type != "cpu"
    args.width = args.width or (4096 if gpu else 256)
    args.batch = args.batch or (8192 if gpu else 64)
    name = torch.cuda.get_device_name() if device.type == "cuda" else device_name
    print(f"device {device_name} ({name}); torch {torch.__version__}; MLP {args.depth} x {args.width}, batch "
          f"{args.batch}; {args.steps} timed steps after {args.warmup}", flush=True)

    header = f"{'case':<13} {'raw ms':>9} {'torchbay ms':>12} {'ratio':>7} {'max |dloss|/loss':>17}  result"
    print(header)
    print("-" * len(header))
    raw_runs = {bf16: raw_loop(args, device, bf16) for bf16 in (False, True)}
    bad = []
    for case in ("fp32", "bf16", "fp8:torchao", "fsdp", "deepspeed"):
        reason = why_not(case, device_name)
        if reason:
            print(f"{case:<13} {'':>9} {'':>12} {'':>7} {'':>17}  skipped: {reason}", flush=True)
            continue
        raw_losses, raw_times = raw_runs[case != "fp32"]
        try:
            losses, times = torchbay_loop(args, case)
        except Exception as exc:  # one case failing must not hide the others
            bad.append(case)
            print(f"{case:<13} {'':>9} {'':>12} {'':>7} {'':>17}  FAILED: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:300]}", flush=True)
            continue
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, raw_losses))
        ok = diff <= TOLERANCE[case] and all(map(lambda v: v == v, losses))  # NaN never passes
        if not ok:
            bad.append(case)
        raw_ms, ours_ms = statistics.median(raw_times) * 1e3, statistics.median(times) * 1e3
        print(f"{case:<13} {raw_ms:>9.2f} {ours_ms:>12.2f} {ours_ms / raw_ms:>7.3f} {diff:>17.2e}  "
              f"{'ok' if ok else f'LOSS DIFFERS (tolerance {TOLERANCE[case]:g})'}", flush=True)
    print("raw for fp8/fsdp/deepspeed is the bf16 autocast loop; ratio > 1 means torchbay is slower")
    if bad:
        print(f"failed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
