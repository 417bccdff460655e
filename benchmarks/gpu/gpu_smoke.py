"""One process on one accelerator: each torchbay path against raw PyTorch and against its engine used directly.

    python benchmarks/gpu/gpu_smoke.py                 # the best installed device (cuda on a GPU)
    python benchmarks/gpu/gpu_smoke.py --device cpu    # the same flow on the CPU (a dry run of this script)
    python benchmarks/gpu/gpu_smoke.py --fp8-sizes 2048,4096,8192   # then the FP8 gain per hidden size

The same model, weights and batches go through three loops per case (docs/architecture.md rule 13:
each engine is judged against itself):

- ``raw``: plain PyTorch, bf16 under ``torch.autocast`` (fp32 for the fp32 case), compiled when the
  case is compiled: the reference of the core's own paths and the bf16 baseline of every case;
- ``direct``: the engine's own API on the same config: torchao ``convert_to_float8_training`` (the
  Linears torchbay converted, the same recipe) + ``torch.compile``; FSDP2 ``fully_shard`` with the
  same ``MixedPrecisionPolicy``; ``deepspeed.initialize`` with the DeepSpeed config torchbay built;
- ``torchbay``: ``Accelerator.prepare`` with the case's settings, out of the box.

The loops of a case live side by side and take turns on each batch (A B C, then C B A), so that
clock and cache drift reach them alike. Loss agreement is judged against ``direct`` where there is
one (else ``raw``); the ratios are torchbay's step time over each reference (median of the timed
steps, device synchronised around each). A case
that cannot run says why; the script exits 1 only when a case that ran disagrees with its reference.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")

#: relative loss agreement with the reference: fp32 up to kernel order, the others within bf16/FP8 rounding
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp8": 5e-2}


@dataclass
class Case:
    name: str
    mode: str                      # fp32 | bf16 | fp8
    compiled: bool = False
    strategy: str = "single"
    direct: str | None = None      # the engine used directly: torchao | fsdp | deepspeed
    config: dict = field(default_factory=dict)


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


@dataclass
class Loop:
    """One training loop, stepped one batch at a time: ``step(x, y) -> loss`` on ``device``."""

    step: Callable
    device: torch.device
    in_dtype: torch.dtype = torch.float32
    close: Callable = lambda: None
    losses: list = field(default_factory=list)
    times: list = field(default_factory=list)

    def run(self, x, y, timed: bool) -> None:
        x, y = x.to(self.device, self.in_dtype), y.to(self.device)
        synchronize(self.device)
        t0 = time.perf_counter()
        loss = self.step(x, y)
        synchronize(self.device)
        if timed:
            self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.item())


def interleave(args, loops: list[Loop]) -> None:
    """Every loop gets every batch; the order alternates A B C, C B A... (clock or cache drift
    reaches each loop alike; a strict A B A B would give B the steps that follow A's)."""
    for i, (x, y) in enumerate(batches(args.steps + args.warmup, args.batch, args.width)):
        for loop in (loops if i % 2 == 0 else loops[::-1]):
            loop.run(x, y, timed=i >= args.warmup)


def plain_step(model: nn.Module, optimizer, forward: Callable, autocast: torch.dtype | None, device) -> Callable:
    def step(x, y):
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            out = forward(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return step


def compile_kwargs(args) -> dict:
    return {"backend": args.compile_backend}


# --- the loops -------------------------------------------------------------------------------------


def raw_loop(args, device, case: Case) -> Loop:
    model = make_model(args.width, args.depth).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model, **compile_kwargs(args)) if case.compiled else model
    return Loop(plain_step(model, opt, forward, None if case.mode == "fp32" else torch.bfloat16, device), device)


def torchbay_loop(args, case: Case, keep: dict) -> Loop:
    from torchbay import Accelerator

    config = copy.deepcopy(case.config)
    config["compile"] = {**config.get("compile", {}), "backend": args.compile_backend}
    if case.mode == "fp8" and args.emulate:
        config.setdefault("fp8", {}).setdefault("engine_options", {})["emulate"] = True
    mixed = {"fp32": "no", "bf16": "bf16", "fp8": "fp8"}[case.mode]
    acc = Accelerator(mixed_precision=mixed, strategy=case.strategy, config=config,
                      **({"device": args.device} if args.device else {}))
    model = make_model(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    if case.direct == "torchao":
        keep["converted"] = list(acc.precision.converted[0])
        keep["emulate"] = acc.precision.emulate
    if case.direct == "deepspeed":
        keep["ds_config"] = copy.deepcopy(acc.strategy.records[0].config)
    keep["compiled"] = acc._compiler.compiled

    def step(x, y):
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    # DeepSpeed's bf16 converts the module itself and casts no input (as under Accelerate)
    in_dtype = next(acc.unwrap_model(model).parameters()).dtype if case.strategy == "deepspeed" else torch.float32
    return Loop(step, acc.device, in_dtype, close=acc.end_training)


def torchao_direct(args, device, case: Case, keep: dict) -> Loop:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = make_model(args.width, args.depth).to(device)
    chosen = set(keep["converted"])
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    if keep["emulate"]:
        config = Float8LinearConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, "emulate": True})
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in chosen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model, **compile_kwargs(args)) if case.compiled else model
    return Loop(plain_step(model, opt, forward, torch.bfloat16, device), device)


def fsdp_direct(args, device, case: Case, keep: dict) -> Loop:
    """On the one-rank process group torchbay's loop started (it ends it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(args.width, args.depth).to(device)
    mesh = init_device_mesh(device.type, (1,))
    # torchbay's config for bf16: parameters gathered in bf16, gradients reduced in fp32, the
    # forward under bf16 autocast; a Sequential of Linears has no block class: the root is the unit
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Loop(plain_step(model, opt, model, torch.bfloat16, device), device)


def deepspeed_direct(args, device, case: Case, keep: dict) -> Loop:
    """On the one-rank process group torchbay's loop started (it ends it)."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    model = make_model(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=keep["ds_config"], dist_init_required=False)

    def step(x, y):
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        return loss

    return Loop(step, device, next(engine.module.parameters()).dtype)


DIRECT = {"torchao": torchao_direct, "fsdp": fsdp_direct, "deepspeed": deepspeed_direct}


# --- which cases run here ----------------------------------------------------------------------------


def cases(args) -> list[Case]:
    off = {"compile": {"enabled": False}}
    on = {"compile": {"enabled": True}}
    fp8 = {"fp8": {"backend": "torchao"}}
    # emulated FP8 (no FP8 matmul here) is not compiled by default: ask for it, to run the path
    fp8_default = {**fp8, **on} if args.emulate else fp8
    return [Case("fp32", "fp32", config=off), Case("bf16", "bf16", config=off),
            Case("bf16 compiled", "bf16", compiled=True, config=on),
            Case("fp8 torchao", "fp8", compiled=True, direct="torchao", config=fp8_default),
            Case("fp8 eager", "fp8", direct="torchao", config={**fp8, **off}),
            Case("fsdp bf16", "bf16", strategy="fsdp", direct="fsdp", config=off),
            Case("zero2 bf16", "bf16", strategy="deepspeed", direct="deepspeed",
                 config={**off, "deepspeed": {"zero_stage": 2, "train_micro_batch_size_per_gpu": args.batch}})]


def why_not(case: Case, device_name: str) -> str | None:
    """Why ``case`` cannot run here, else None."""
    import importlib.util

    from torchbay.registry.manager import get_plugin_manager

    registries = get_plugin_manager().registries()
    if case.mode == "fp8":
        if registries["precisions"].get("fp8:torchao") is None:
            return "torchbay-fp8-torchao is not installed"
    if case.strategy != "single":
        if case.strategy not in registries["strategies"]:
            return f"torchbay-{case.strategy} is not installed"
        if importlib.util.find_spec(case.strategy) is None and case.strategy == "deepspeed":
            return "deepspeed is not installed"
    return None


def fp8_emulated(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability() < (8, 9)


# --- the tables ------------------------------------------------------------------------------------


def rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def run_case(args, device, device_name, case: Case) -> tuple[str, bool]:
    reason = why_not(case, device_name)
    if reason:
        return f"{case.name:<14} skipped: {reason}", True
    raw_case = Case(case.name, "fp32" if case.mode == "fp32" else "bf16", compiled=case.compiled)
    keep: dict = {}
    loops: list[Loop] = []
    try:
        loops.append(torchbay_loop(args, case, keep))  # first: it starts the process group the others use
        loops.append(raw_loop(args, device, raw_case))
        if case.direct:
            loops.append(DIRECT[case.direct](args, device, case, keep))
        interleave(args, loops)
    except Exception as exc:  # one case failing must not hide the others
        return f"{case.name:<14} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", False
    finally:
        for loop in reversed(loops):
            loop.close()
    ours, raw = loops[0], loops[1]
    direct = loops[2] if case.direct else None
    diff = rel_diff(ours.losses, (direct or raw).losses)
    tolerance = TOLERANCE[case.mode]
    ok = diff <= tolerance and all(v == v for v in ours.losses)  # NaN never passes
    ms, raw_ms = statistics.median(ours.times) * 1e3, statistics.median(raw.times) * 1e3
    direct_ms = statistics.median(direct.times) * 1e3 if direct else float("nan")
    verdict = "ok" if ok else f"LOSS DIFFERS from {case.direct or 'raw'} (tolerance {tolerance:g})"
    if case.compiled and keep.get("compiled") in ([], [[]]):
        verdict, ok = verdict + "; torchbay compiled nothing", False
    tflops = step_flops(args) / (ms / 1e3) / 1e12
    peak = args.peaks.get(case.mode)
    mfu = f"{tflops * 1e12 / peak:>6.1%}" if peak else f"{'-':>6}"
    return (f"{case.name:<14} {raw_ms:>9.2f} {direct_ms:>10.2f} {ms:>11.2f} {ms / raw_ms:>7.3f} "
            f"{ms / direct_ms:>9.3f} {tflops:>7.1f} {mfu} {diff:>11.2e}  {verdict}"), ok


def step_flops(args) -> int:
    """Model FLOPs of one step of the MLP: every matmul weight 6 x rows (2 forward, 4 backward); exact for this
    model, as FlopCounterMode counts it (torchbay.telemetry; the bias adds and GELU are not counted)."""
    return 6 * (args.depth * args.width * args.width + args.width * 16) * args.batch


def fp8_sizes(args, device) -> None:
    """FP8 gain per hidden size, out of the box: torchbay FP8 against the compiled bf16 loop (the
    comparison with torchao used directly is the main table's, at the main width)."""
    print(f"\nFP8 (torchao) per hidden size, out of the box: MLP {args.depth} x H, batch {args.batch}; ms per step")
    header = f"{'hidden':>6} {'bf16 raw+compile':>17} {'torchbay fp8':>13} {'gain':>7}  converted"
    print(header)
    print("-" * len(header))
    for width in args.fp8_sizes:
        sized = argparse.Namespace(**{**vars(args), "width": width})
        case = Case("fp8", "fp8", compiled=True, direct="torchao",
                    config={"fp8": {"backend": "torchao"}, **({"compile": {"enabled": True}} if args.emulate else {})})
        keep: dict = {}
        loops: list[Loop] = []
        try:
            loops.append(torchbay_loop(sized, case, keep))
            loops.append(raw_loop(sized, device, Case("bf16", "bf16", compiled=True)))
            interleave(sized, loops)
        except Exception as exc:
            print(f"{width:>6} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        finally:
            for loop in reversed(loops):
                loop.close()
        ours, bf16 = loops
        b, t = (statistics.median(loop.times) * 1e3 for loop in (bf16, ours))
        print(f"{width:>6} {b:>17.2f} {t:>13.2f} {b / t:>6.2f}x  {len(keep['converted'])} Linear(s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="torchbay device name (default: the best installed)")
    parser.add_argument("--width", type=int, default=None, help="hidden width (GPU default 8192, CPU 256)")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="rows per step (GPU default 16384, CPU 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (GPU default 15, CPU 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (GPU 5, CPU 2)")
    parser.add_argument("--compile-backend", default=None, help="GPU default inductor, CPU aot_eager")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--fp8-sizes", default="", help="also the FP8 gain at these hidden sizes, e.g. 2048,4096,8192")
    args = parser.parse_args(argv)

    from torchbay import Accelerator

    probe = Accelerator(**({"device": args.device} if args.device else {}))
    device, device_name = probe.device, probe.device_backend.name
    # MFU's peak per row's math: the device plugin's published figure (DeviceBackend.peak_flops), None if unknown
    args.peaks = {mode: probe.device_backend.peak_flops(mode) for mode in ("fp32", "bf16", "fp8")}
    probe.end_training()
    gpu = device.type != "cpu"
    args.width = args.width or (8192 if gpu else 256)
    args.batch = args.batch or (16384 if gpu else 64)
    args.steps = args.steps or (15 if gpu else 4)
    args.warmup = args.warmup or (5 if gpu else 2)
    args.compile_backend = args.compile_backend or ("inductor" if gpu else "aot_eager")
    args.emulate = fp8_emulated(device)
    args.fp8_sizes = [int(s) for s in args.fp8_sizes.split(",") if s]
    name = torch.cuda.get_device_name() if device.type == "cuda" else device_name
    print(f"device {device_name} ({name}); torch {torch.__version__}; MLP {args.depth} x {args.width}, batch "
          f"{args.batch}; {args.steps} timed steps after {args.warmup}; compile backend {args.compile_backend}"
          f"{'; FP8 EMULATED (its times mean nothing)' if args.emulate else ''}", flush=True)
    peaks = ", ".join(f"{m} {p / 1e12:g}" for m, p in args.peaks.items() if p) or "unknown (no MFU)"
    print(f"peak TFLOP/s (device plugin): {peaks}; TFLOP/s and MFU are torchbay's, against the row's math")
    header = (f"{'case':<14} {'raw ms':>9} {'direct ms':>10} {'torchbay ms':>11} {'tb/raw':>7} {'tb/direct':>9} "
              f"{'TFLOP/s':>7} {'MFU':>6} {'dloss/loss':>11}  result")
    print(header)
    print("-" * len(header))
    wanted = set(args.cases.split(",")) if args.cases else None
    bad = []
    for case in cases(args):
        if wanted and case.name not in wanted:
            continue
        row, ok = run_case(args, device, device_name, case)
        print(row, flush=True)
        if not ok:
            bad.append(case.name)
    print("raw: the plain loop (bf16 autocast, compiled for the compiled cases); direct: the engine's own API on "
          "the same config; dloss against direct where there is one, else raw; ratios > 1: torchbay is slower")
    if args.fp8_sizes:
        fp8_sizes(args, device)
    if bad:
        print(f"failed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
