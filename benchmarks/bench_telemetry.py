"""Telemetry's cost on the training step, in one run (1 process, 1 thread): the same small GPT trained by a raw
loop, by torchbay with telemetry off (the default) and by torchbay with ``telemetry.enabled`` (a record every 10
steps, written to the jsonl tracker).

The step time is the loop's CPU time (this thread's: torch runs with one thread) after the first step (the first
step is run before the clock starts: with telemetry on it is the counting step, whose FLOPs ``FlopCounterMode``
counts; its own cost is the last row). Every
contender starts from the same seed and data; torchbay's weights must equal the raw loop's, bit for bit, with
telemetry on or off (the benchmark stops if not).

    python benchmarks/bench_telemetry.py [--steps 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_ENV, interleaved  # noqa: E402

VOCAB, LAYERS, SEQ, BATCH = 256, 2, 64, 8
DIM = 128  # --width: 8 leaves the framework's own per-step cost (the model takes almost no time)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.blocks(self.embed(input_ids)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make(steps: int):
    torch.manual_seed(0)
    model = GPT()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, ((steps + 1) * BATCH, SEQ + 1), generator=g)
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), DataLoader(data, batch_size=BATCH)


def raw(steps: int):
    model, opt, loader = make(steps)
    batches = iter(loader)

    def step():
        batch = next(batches)
        model(**batch).backward()
        opt.step()
        opt.zero_grad()

    step()
    return timed_steps(step, steps), model


def torchbay(steps: int, telemetry: bool, workdir: str):
    from torchbay import Accelerator

    shutil.rmtree(workdir, ignore_errors=True)
    acc = Accelerator(device="cpu", project_dir=workdir, log_with="jsonl",
                      config={"telemetry": {"enabled": telemetry, "every_n_steps": 10}})
    model, opt, loader = make(steps)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.init_trackers("bench")
    if telemetry:
        inside = instrument(acc.telemetry)
    batches = iter(loader)

    def step():
        batch = next(batches)
        acc.backward(model(**batch))
        opt.step()
        opt.zero_grad()

    first = timed_steps(step, 1)
    if telemetry:
        inside[0] = 0.0
    seconds = timed_steps(step, steps)
    if telemetry:
        INSIDE.append(inside[0] / steps)
    batches.close()
    acc.end_training()
    return seconds, model, first


#: CPU seconds per step spent inside telemetry's own methods, per round (telemetry on)
INSIDE: list[float] = []


def instrument(monitor) -> list[float]:
    """Time (this thread's CPU) every call the loop makes into the monitor: ``on_batch`` (each batch) and
    ``after_optimizer_step`` (each step, with the record every N steps); the generator that hands batches over adds
    a frame per batch, not counted (about a microsecond)."""
    total = [0.0]

    def timed(method):
        def call(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                total[0] += time.thread_time() - start
        return call

    monitor.on_batch = timed(monitor.on_batch)
    monitor.after_optimizer_step = timed(monitor.after_optimizer_step)
    return total


def timed_steps(step, n: int) -> float:
    """CPU seconds of this thread over ``n`` steps (torch runs on this one thread): time the shared machine gave
    other processes is not counted, so the ratios hold on a loaded machine where wall time moves by tens of %."""
    start = time.thread_time()
    for _ in range(n):
        step()
    return time.thread_time() - start


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--width", type=int, default=DIM)
    args = parser.parse_args()
    globals()["DIM"] = args.width
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench-telemetry-")
    firsts: dict[str, list[float]] = {"off": [], "on": []}
    reference = {}

    def contender(name):
        def run():
            if name == "raw":
                seconds, model = raw(args.steps)
                reference["raw"] = model
                return seconds
            seconds, model, first = torchbay(args.steps, name == "on", os.path.join(workdir, name))
            firsts[name].append(first)
            if "raw" in reference and not same(model, reference["raw"]):
                raise SystemExit(f"torchbay with telemetry {name} ended with other weights than the raw loop")
            return seconds
        return run

    values = interleaved({name: contender(name) for name in ("raw", "off", "on")}, args.rounds)
    shutil.rmtree(workdir, ignore_errors=True)

    def ratio(a: str, b: str) -> str:
        r = [x / y for x, y in zip(values[a], values[b])]
        return f"{statistics.median(r):.3f}x [{min(r):.3f}-{max(r):.3f}]"

    per_step = {k: statistics.median(v) / args.steps * 1e3 for k, v in values.items()}
    first_on, first_off = statistics.median(firsts["on"]), statistics.median(firsts["off"])
    params = sum(p.numel() for p in GPT().parameters())
    lines = [f"### Telemetry: step time with telemetry on vs off, width {DIM} (1 process, 1 thread)", "",
             f"A GPT of {params / 1e6:.2f} M parameters ({LAYERS} layers, width {DIM}, {SEQ} tokens x batch {BATCH}, "
             f"AdamW), {args.steps} steps per loop after one step off the clock; telemetry records every 10 steps "
             f"to the jsonl tracker. Weights bit-identical to the raw loop's with telemetry on and off (checked every "
             f"round). CPU time of the training thread; median ratio over {args.rounds} interleaved rounds, "
             f"[lowest-highest] in brackets.", "",
             "| comparison | ratio | median step | target |", "|---|---|---|---|",
             f"| torchbay, telemetry off vs raw loop | {ratio('off', 'raw')} | {per_step['off']:.2f} ms vs "
             f"{per_step['raw']:.2f} ms | telemetry off costs nothing (the core's own cost, bench_core.py) |",
             f"| torchbay, telemetry on vs telemetry off | {ratio('on', 'off')} | {per_step['on']:.3f} ms vs "
             f"{per_step['off']:.3f} ms ({(per_step['on'] - per_step['off']) * 1e3:+.0f} us) | <= 1.01x |",
             f"| time inside telemetry's own methods per step (telemetry on), share of the step | "
             f"{statistics.median(INSIDE) / (per_step['on'] / 1e3):.3%} [{min(INSIDE) * 1e6:.0f}-"
             f"{max(INSIDE) * 1e6:.0f} us] | {statistics.median(INSIDE) * 1e6:.0f} us | <= 1% |",
             f"| the first step (with telemetry on: the FLOP counting step), on vs off | "
             f"{first_on / first_off:.2f}x | {first_on * 1e3:.1f} ms vs {first_off * 1e3:.1f} ms | once per run |",
             ""]
    text = "\n".join(lines)
    print(text, flush=True)
    if os.environ.get(RESULTS_ENV):
        import json

        with open(os.environ[RESULTS_ENV], "a") as out:
            out.write(json.dumps({"title": lines[0][4:], "markdown": text}) + "\n")
    assert math.isfinite(per_step["on"])


if __name__ == "__main__":
    main()
