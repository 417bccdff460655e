"""Pipeline parallel on CPU (gloo): the same model and global batch at 1 process, dp 2 and pp 2 with each
schedule; torchbay's pp 2 against the same schedule driven by raw torch.distributed.pipelining on the same split.

For each pp run: the step time, the measured bubble (1 - the rank's compute time / the step time, where the
compute time is its stages' forward and backward over the same micro-batches run alone, without the pipeline;
the mean over ranks) beside the schedule's theoretical bubble, and torchbay / raw. Raw is what a user writes
with torch alone on the split torchbay makes (PipelineStage, the torch schedule class, a plain optimizer loop);
torchbay runs the usual loop with ``accelerator.pipeline_loss``. Every contender is started by
torch.distributed.run and times only its steps, between barriers; rounds alternate torchbay and raw.

    python benchmarks/bench_pipeline.py [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
VOCAB, DIM, BLOCKS, SEQ, BATCH, MICRO, WARMUP = 256, 128, 8, 32, 16, 4, 2


def make_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            h = self.norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

        def forward(self, tokens):
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return GPT()


def loss_fn(logits, target):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batches(steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=g)


def compute_seconds(stages, n_micro: int, batch) -> float:
    """The stages' forward and backward over ``n_micro`` micro-batches, run alone (no pipeline, no comms)."""
    import torch

    tokens = batch.chunk(n_micro)
    start = time.perf_counter()
    for mb in tokens:
        for stage in stages:
            received = () if stage.index == 0 else (torch.randn(mb.shape[0], SEQ, DIM, requires_grad=True),)
            out = stage(*received, inputs=(mb[:, :-1],))
            (loss_fn(out, mb[:, 1:]) if stage.index == stage.num_stages - 1 else out.sum()).backward()
    for stage in stages:
        stage.zero_grad()
    return time.perf_counter() - start


def run_one(mode: str, schedule: str, steps: int) -> dict:
    """One contender's timed steps: ``single``/``dp`` (torchbay, the whole model), ``pp`` (torchbay) or ``raw``
    (torch.distributed.pipelining alone) with ``schedule``; the step time (slowest rank) and measured bubble."""
    import copy

    import torch
    import torch.distributed as dist

    data = batches(WARMUP + steps)
    model = make_model()
    stages = []
    if mode == "raw":
        from torch.distributed.pipelining import PipelineStage, schedules
        from torchbay_fsdp.pipeline.schedule import stage_indices
        from torchbay_fsdp.pipeline.split import plan_split
        from torchbay_fsdp.pipeline.stage import cut

        from torchbay.distributed.pipeline_config import SCHEDULES as INFO

        rank, world = dist.get_rank(), dist.get_world_size()
        held = stage_indices(schedule, rank, world, None)
        plan = plan_split(model, world * len(held))  # the split torchbay makes
        copies = [model] + [copy.deepcopy(model) for _ in held[1:]]
        stages = [cut(m, plan, i, copy_model=False) for m, i in zip(copies, held)]
        pipe = [PipelineStage(s, i, plan.num_stages, torch.device("cpu")) for s, i in zip(stages, held)]
        cls = getattr(schedules, INFO[schedule].torch_class)
        sched = cls(pipe if INFO[schedule].multi else pipe[0], n_microbatches=MICRO, loss_fn=loss_fn)
        opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-3)

        def step(batch):
            sched.step(inputs=(batch[:, :-1],), target=batch[:, 1:], losses=[])
            opt.step()
            opt.zero_grad()
        barrier = dist.barrier
    else:
        from torchbay import Accelerator, ParallelismConfig

        if mode == "pp":
            acc = Accelerator(strategy="fsdp", parallelism_config=ParallelismConfig(
                pp_size=dist.get_world_size(), pp_schedule=schedule, pp_microbatches=MICRO))
        else:
            acc = Accelerator(strategy="ddp" if mode == "dp" else "single")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        dp = acc.strategy.data_parallel_size
        stages = list(getattr(model, "_stage_modules", []))

        def step(batch):
            batch = batch.chunk(dp)[acc.data_parallel_rank] if mode == "dp" else batch
            loss = acc.pipeline_loss(model, batch[:, :-1], batch[:, 1:], loss_fn)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        barrier = acc.wait_for_everyone
    for batch in data[:WARMUP]:
        step(batch)
    barrier()
    start = time.perf_counter()
    for batch in data[WARMUP:]:
        step(batch)
    barrier()
    step_s = (time.perf_counter() - start) / steps
    busy = compute_seconds(stages, MICRO, data[0]) if stages else step_s
    result = {"step_s": step_s, "bubble": 1 - busy / step_s}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        result = {"step_s": max(r["step_s"] for r in gathered),
                  "bubble": statistics.mean(r["bubble"] for r in gathered)}
    return result


def worker(mode: str, steps: int, rounds: int, schedules: list[str]) -> None:
    """``single``/``dp``: that contender ``rounds`` times; ``pp``: every schedule, torchbay and raw
    alternating, ``rounds`` times, all in one process group. Prints the results (JSON) on rank 0."""
    import torch

    from torchbay import Accelerator

    torch.set_num_threads(1)
    owner = Accelerator(strategy="ddp") if mode != "single" else None  # the process group for every run
    results: dict = {}
    for r in range(rounds):
        if mode != "pp":
            results.setdefault(mode, []).append(run_one(mode, "-", steps))
            continue
        for schedule in schedules:
            for contender in (("pp", "raw") if r % 2 == 0 else ("raw", "pp")):
                results.setdefault(f"{contender} {schedule}", []).append(run_one(contender, schedule, steps))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(results), flush=True)
    if owner is not None:
        owner.end_training()


def launch(mode: str, steps: int, rounds: int, nproc: int, schedules: str = ",".join(SCHEDULES)) -> dict:
    from common import child_env

    env = child_env()
    for key in [k for k in env if k.startswith(("TORCHBAY_", "ACCELERATE_"))]:
        env.pop(key)
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-W", "ignore::UserWarning", "-m", "torch.distributed.run",
                           f"--nproc-per-node={nproc}", "--standalone", os.path.abspath(__file__), "--worker", mode,
                           "--steps", str(steps), "--rounds", str(rounds), "--schedules", schedules],
                          capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{mode} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of the schedules")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.rounds, args.schedules.split(","))
    from torchbay_fsdp.pipeline.schedule import theoretical_bubble

    def median(results, key, field="step_s"):
        return statistics.median(x[field] for x in results[key])

    single = median(launch("single", args.steps, args.rounds, 1), "single")
    dp = median(launch("dp", args.steps, args.rounds, 2), "dp")
    pp = launch("pp", args.steps, args.rounds, 2, args.schedules)
    params = sum(t.numel() for t in make_model().parameters())
    print(f"bench_pipeline: {BLOCKS} blocks, width {DIM}, {params / 1e6:.2f}M params, AdamW, global batch {BATCH} x "
          f"{SEQ} tokens, {MICRO} micro-batches, CPU (gloo, 1 thread per process), {args.steps} timed steps after "
          f"{WARMUP}, median of {args.rounds} rounds")
    print("| run | step s | vs 1 process | bubble measured | bubble theory | torchbay / raw pp |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| 1 process | {single:.3f} | 1.00x | - | - | - |")
    print(f"| dp 2 (ddp) | {dp:.3f} | {dp / single:.2f}x | - | - | - |")
    for schedule in args.schedules.split(","):
        ours, raw = pp[f"pp {schedule}"], pp[f"raw {schedule}"]
        step = statistics.median(x["step_s"] for x in ours)
        ratio = statistics.median(a["step_s"] / b["step_s"] for a, b in zip(ours, raw))
        bubble = statistics.median(x["bubble"] for x in ours)
        print(f"| pp 2 {schedule} | {step:.3f} | {step / single:.2f}x | {bubble:.2f} | "
              f"{theoretical_bubble(schedule, 2, MICRO):.2f} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
