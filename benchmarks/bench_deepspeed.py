"""Step time and peak memory per rank: DDP vs DeepSpeed ZeRO-2 / ZeRO-3 under torchbay, and
torchbay+DeepSpeed vs the same loop written against DeepSpeed directly.

    python benchmarks/bench_deepspeed.py [--steps 30] [--width 1024] [--layers 8] [--repeats 2]

Each configuration runs in its own 2-process launch (torch.distributed.run, gloo, CPU, one
thread per process), so peak memory is that configuration's alone. The torchbay and raw
DeepSpeed launches alternate ``--repeats`` times and the medians are compared; then, since a
shared machine's load moves more than 3% between launches, one launch per stage steps the
same engine alternately through torchbay's loop and directly (``engine.backward``/``step``),
which isolates torchbay's own cost.

Step time: median over the timed steps of each rank's wall time per optimizer step (forward,
backward, step), the slower rank reported. Peak memory: the rise of each rank's resident-set
high-water mark (VmHWM, reset after the process group / Accelerator is up, just before the
model is built) over its resident set then: model, gradients, optimizer state, buffers.
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


# --- worker ----------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # imported in every mode, so the baselines match

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def build():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.GELU()]
        return nn.Sequential(*layers, nn.Linear(args.width, 1))

    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))
               for _ in range(args.steps + args.warmup)]
    mode = args.worker
    acc = None
    if mode.startswith("raw"):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False)
    else:
        from torchbay import Accelerator

        if mode == "ddp":
            acc = Accelerator(strategy="ddp")
        else:
            acc = Accelerator(strategy="deepspeed", config={"deepspeed": {
                "zero_stage": int(mode[-1]), "train_micro_batch_size_per_gpu": args.batch}})
    __import__("gc").collect()
    base_rss = _rss_kib("VmRSS")
    _reset_peak()
    times = []
    raw_times = []
    if mode.startswith("ab"):
        # the same engine, stepped alternately through torchbay and directly: the difference is torchbay's layer
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        inside = [0.0]  # seconds spent inside the engine's own backward/step during torchbay steps

        def timed(fn):
            def run(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    inside[0] += time.perf_counter() - t
            return run

        engine_backward, engine_step = model.backward, model.step
        layer_us = []
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            through_torchbay = i % 4 in (0, 3)  # ABBA: each way takes the step after either kind equally often
            if through_torchbay:
                model.backward, model.step = timed(engine_backward), timed(engine_step)
                inside[0] = 0.0
                with acc.accumulate(model):
                    tf = time.perf_counter()
                    out = model(x)
                    inside[0] += time.perf_counter() - tf
                    loss = nn.functional.mse_loss(out, y)
                    acc.backward(loss)
                    opt.step()
                    opt.zero_grad()
                model.backward, model.step = engine_backward, engine_step
                if i >= args.warmup:  # everything but the engine's forward/backward/step (and the loss)
                    layer_us.append((time.perf_counter() - t0 - inside[0]) * 1e6)
            else:
                loss = nn.functional.mse_loss(model(x), y)
                model.backward(loss)
                model.step()
            if i >= args.warmup:
                (times if through_torchbay else raw_times).append(time.perf_counter() - t0)
    elif mode.startswith("raw"):
        stage = int(mode[-1])
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "train_batch_size": args.batch * dist.get_world_size(), "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    else:
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    peak = _rss_kib("VmHWM")
    row = {"step_ms": statistics.median(times) * 1e3, "peak_rise_mib": (peak - base_rss) / 1024,
           "peak_rss_mib": peak / 1024, "loss": float(loss.detach())}
    if raw_times:
        row["direct_step_ms"] = statistics.median(raw_times) * 1e3
        row["torchbay_layer_us"] = statistics.median(layer_us)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    if acc is not None:
        acc.end_training()  # the group is the benchmark's (joined above), so torchbay leaves it
    sys.path.insert(0, HERE)
    from common import destroy_process_group_safely

    destroy_process_group_safely()


# --- driver ----------------------------------------------------------------------------------


def launch(mode: str, args, tmp: str) -> list[dict]:
    sys.path.insert(0, os.path.join(HERE, "..", "core"))
    from torchbay.testing.processes import run_torchrun

    out = os.path.join(tmp, f"{mode}_{time.time_ns()}.json")
    argv = ["--worker", mode, "--out", out, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch)]
    run_torchrun(os.path.abspath(__file__), 2, argv, timeout=600).check()
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--only-interleaved", action="store_true", help="skip the separate launches")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    params = args.layers * (args.width * args.width + args.width) + args.width + 1
    print(f"model: {args.layers} x Linear({args.width}) MLP, {params / 1e6:.2f}M fp32 parameters, AdamW; "
          f"2 processes, gloo, 1 thread each; {args.steps} timed steps after {args.warmup}")
    results: dict[str, list[list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(0 if args.only_interleaved else args.repeats):
            for mode in ("ddp", "zero2", "zero3", "raw2", "raw3"):
                results.setdefault(mode, []).append(launch(mode, args, tmp))
        for mode in ("ab2", "ab3"):
            results[mode] = [launch(mode, args, tmp)]

    def step_ms(mode, key="step_ms"):  # median over repeats of the slower rank
        return statistics.median(max(r[key] for r in run) for run in results[mode])

    def peak(mode, rank):
        return statistics.median(run[rank]["peak_rise_mib"] for run in results[mode])

    for mode in ("ddp", "zero2", "zero3", "raw2", "raw3"):
        results.setdefault(mode, [])
    print(f"\nseparate launches ({0 if args.only_interleaved else args.repeats} each, median; "
          "the machine is shared, so step times carry its load):")
    print(f"{'strategy':<26}{'step ms':>10}{'peak rise MiB r0':>18}{'r1':>8}{'peak RSS MiB r0':>17}")
    labels = {"ddp": "torchbay DDP", "zero2": "torchbay ZeRO-2", "zero3": "torchbay ZeRO-3",
              "raw2": "DeepSpeed direct ZeRO-2", "raw3": "DeepSpeed direct ZeRO-3"}
    for mode in [m for m in ("ddp", "zero2", "zero3", "raw2", "raw3") if results[m]]:
        print(f"{labels[mode]:<26}{step_ms(mode):>10.1f}{peak(mode, 0):>18.1f}{peak(mode, 1):>8.1f}"
              f"{statistics.median(run[0]['peak_rss_mib'] for run in results[mode]):>17.1f}")
    overhead = {}
    for stage in (2, 3):
        sep = (step_ms(f"zero{stage}") / step_ms(f"raw{stage}") - 1) * 100 if results["raw2"] else float("nan")
        ab = (step_ms(f"ab{stage}") / step_ms(f"ab{stage}", "direct_step_ms") - 1) * 100
        overhead[f"zero{stage}_separate_pct"], overhead[f"zero{stage}_interleaved_pct"] = sep, ab
        print(f"torchbay+DeepSpeed vs DeepSpeed direct, ZeRO-{stage}: separate launches {sep:+.1f}%; same engine, "
              f"steps interleaved: {step_ms(f'ab{stage}'):.1f} vs {step_ms(f'ab{stage}', 'direct_step_ms'):.1f} ms "
              f"= {ab:+.1f}% (target within 3%)")
        layer = statistics.median(max(r["torchbay_layer_us"] for r in run) for run in results[f"ab{stage}"])
        overhead[f"zero{stage}_torchbay_layer_us"] = layer
        print(f"  torchbay's own time per step (outside the engine's forward/backward/step, loss included): "
              f"{layer:.0f} us = {layer / 10 / step_ms(f'ab{stage}'):.3f}% of the step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "overhead_pct": overhead, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
