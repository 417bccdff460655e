"""bf16 against FP8 through every installed torchbay FP8 engine, side by side, on one model.

The model is a stack of pre-norm transformer blocks (LayerNorm, fused QKV projection,
scaled-dot-product attention, output projection, 4x GELU MLP) at hidden sizes from 1024 to
8192. For each hidden size, the same initial weights and batch go through ``bf16`` and
``fp8`` with each engine (``torchao``, ``te``, ``msamp``); the table shows tokens/s, the
FP8/bf16 throughput ratio, how far the FP8 loss curve strays from bf16's, and what the
small-layer rule of the FP8 plugins (``K*N/(K+N) >= 1024``) predicts for the block's GEMMs.
On a GPU the ratio column is what the rule is calibrated against: where the rule says
"small", the measured ratio should be near or below 1.

On a machine without an FP8 GPU only torchao runs, in emulation (FP8 numerics computed in
high precision): its throughput there says nothing about FP8 speed, and the script says so;
on CPU it adds an fp32 row, since CPU bf16 matmuls are often slower than fp32 ones.

    python benchmarks/bench_fp8.py                      # GPU: 1024..8192; CPU: tiny, emulated
    python benchmarks/bench_fp8.py --hidden 1024,2048 --layers 2 --tokens 4096 --steps 20
    python benchmarks/bench_fp8.py --numerics           # per recipe (tensorwise, rowwise, mxfp8, mxfp4): loss
                                                        # gap to bf16 and quantization error per layer type
                                                        # (emulated, CPU; benchmarks/precision_numerics.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time

import torch
import torch.nn.functional as F

from torchbay import Accelerator
from torchbay.errors import TorchbayError
from torchbay.registry.manager import get_plugin_manager

ENGINES = ("torchao", "te", "msamp")
RULE = 1024  # the FP8 plugins' SMALL_LAYER_HARMONIC


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(torch.nn.Module):
    def __init__(self, hidden: int, layers: int):
        super().__init__()
        heads = max(1, hidden // 128)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def gemm_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    return {"qkv": (hidden, 3 * hidden), "proj": (hidden, hidden), "fc1": (hidden, 4 * hidden),
            "fc2": (4 * hidden, hidden)}


def rule_says(hidden: int) -> str:
    small = [n for n, (k, o) in gemm_shapes(hidden).items() if k * o / (k + o) < RULE]
    return "gain" if not small else f"small: {','.join(small)}"


def measure(mode: str, engine: str | None, args, hidden: int, device: str) -> dict:
    config: dict = {}
    if engine:
        options = {"small_layer_threshold": 0}
        if engine == "torchao" and args.emulate:
            options["emulate"] = True
        config = {"fp8": {"backend": engine, "keep_first_and_last": False, "engine_options": options}}
    # bf16 and FP8 alike compiled or not: torchbay's FP8 default compiles where FP8 kernels run
    config["compile"] = {"enabled": args.compile}
    acc = Accelerator(mixed_precision=mode, device=device, config=config)
    torch.manual_seed(0)
    model = Stack(hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = acc.prepare(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    seq = min(args.seq, args.tokens)
    batch = max(1, args.tokens // seq)
    x = torch.randn(batch, seq, hidden, generator=gen).to(acc.device)
    y = torch.randn(batch, seq, hidden, generator=gen).to(acc.device)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        acc.device_backend.synchronize()
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x).float(), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        acc.device_backend.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    converted = sum(len(c) for c in getattr(acc.precision, "converted", []) or [])
    del model, optimizer, x, y
    acc.free_memory()
    gc.collect()
    step_s = sorted(times)[len(times) // 2]
    return {"tokens_per_s": batch * seq / step_s, "step_s": step_s, "losses": losses, "converted": converted,
            "precision": acc.precision.describe()}


def engine_reason(engine: str, device: str, emulate: bool) -> str | None:
    registry = get_plugin_manager().registries()["precisions"]
    cls = registry.get(f"fp8:{engine}")
    if cls is None:
        return f"torchbay-fp8-{engine} is not installed"
    device_cls = get_plugin_manager().registries()["devices"].get(device)
    reason = cls.unavailable_reason(device_cls) if device_cls else f"device {device} not installed"
    return reason


def main(argv=None) -> int:
    logging.basicConfig(level=logging.ERROR)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="torchbay device name (default: the best installed)")
    p.add_argument("--hidden", default=None, help="comma-separated hidden sizes (GPU default 1024..8192)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="tokens per step")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile every mode (default: on a GPU, off on a CPU)")
    p.add_argument("--numerics", action="store_true",
                   help="print the numerics table instead (emulated, CPU): see benchmarks/precision_numerics.py")
    p.add_argument("--vocab", type=int, default=256, help="--numerics: vocabulary")
    p.add_argument("--blocks", type=int, default=4, help="--numerics: transformer blocks")
    p.add_argument("--batch", type=int, default=8, help="--numerics: sequences per step")
    args = p.parse_args(argv)
    if args.numerics:
        from precision_numerics import numerics_table

        args.hidden = int(args.hidden or 128)
        args.seq = 64 if args.seq == 512 else args.seq
        args.steps = args.steps or 20
        args.lr = 1e-3 if args.lr == 1e-4 else args.lr
        print(numerics_table(args))
        return 0

    probe = Accelerator(device=args.device) if args.device else Accelerator()
    device = probe.device_backend.name
    gpu = device != "cpu"
    args.hidden = [int(h) for h in (args.hidden or ("1024,2048,4096,8192" if gpu else "1024")).split(",")]
    args.layers = args.layers or (4 if gpu else 1)
    args.tokens = args.tokens or (16384 if gpu else 64)
    args.steps = args.steps or (20 if gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.seq = min(args.seq, args.tokens)
    args.compile = gpu if args.compile is None else args.compile
    args.emulate = not gpu or (gpu and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9))
    engines = []
    print(f"device: {device}; hidden sizes {args.hidden}; {args.layers} block(s); {args.tokens} tokens/step; "
          f"{args.steps} timed steps after {args.warmup} warm-up; {'compiled' if args.compile else 'eager'}")
    for engine in args.engines.split(","):
        reason = engine_reason(engine, device, args.emulate)
        if reason:
            print(f"  fp8 {engine}: skipped ({reason})")
        else:
            engines.append(engine)
    if args.emulate and "torchao" in engines:
        print("  NOTE: torchao runs in EMULATION here (no FP8 matmul on this device): FP8 numerics in high "
              "precision, so its speed says nothing about FP8 speed; the loss columns are meaningful.")

    results = []
    header = (f"{'hidden':>6} {'mode':<14} {'conv':>4} {'tok/s':>10} {'x bf16':>7} {'max|dloss|':>10} "
              f"{'final dloss':>11}  rule")
    print(header)
    print("-" * len(header))
    for hidden in args.hidden:
        try:
            base = measure("bf16", None, args, hidden, device)
        except (RuntimeError, TorchbayError) as exc:
            print(f"{hidden:>6} bf16 failed: {str(exc).splitlines()[0]}")
            continue
        rows = [("bf16", base)]
        if not gpu:  # CPU bf16 matmuls are often slower than fp32 ones: show both
            rows.append(("fp32", measure("no", None, args, hidden, device)))
        for engine in engines:
            try:
                rows.append((f"fp8:{engine}", measure("fp8", engine, args, hidden, device)))
            except (RuntimeError, TorchbayError) as exc:
                print(f"{hidden:>6} fp8:{engine} failed: {str(exc).splitlines()[0]}")
        for name, r in rows:
            rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], base["losses"])]
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
            print(f"{hidden:>6} {name:<14} {r['converted']:>4} {r['tokens_per_s']:>10.0f} {ratio:>7.2f} "
                  f"{max(rel):>10.2e} {rel[-1]:>11.2e}  {rule_says(hidden) if name.startswith('fp8') else ''}")
            results.append({"hidden": hidden, "mode": name, **r, "ratio_vs_bf16": ratio,
                            "max_rel_loss_diff": max(rel), "final_rel_loss_diff": rel[-1],
                            "rule": rule_says(hidden), "emulated": args.emulate and name == "fp8:torchao"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "args": {k: v for k, v in vars(args).items()}, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
