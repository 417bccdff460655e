"""What the benchmarks share: interleaved repetitions, medians and spreads, peak memory, the
machine they ran on, and the results that ``make bench`` (benchmarks/run_all.py) writes into
docs/performance.md.

A benchmark compares contenders (``raw``, ``accelerate`` when it is installed, ``torchbay``)
on one path. Each round runs every contender once, in an order that rotates from round to
round, so that noise on a shared machine hits each alike; a contender's result is the median
over rounds of its ratio to ``raw`` in the same round, with the smallest and largest ratio as
the spread. One timing is never reported.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

#: where run_all.py collects every benchmark's tables (JSON lines); unset when a benchmark runs alone
RESULTS_ENV = "BENCH_RESULTS_JSONL"  # (not TORCHBAY_*: those are torchbay settings)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accelerate_available() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide singletons, so that the next ``accelerate.Accelerator``
    may choose another mixed precision or accumulation (as its own tests do between cases)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def interleaved(contenders: Mapping[str, Callable[[], float]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every contender ``warmup + rounds`` times, rotating the order each round; each call
    returns the value to compare (seconds it timed itself, or bytes). Warm-up rounds are dropped."""
    names = list(contenders)
    values: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            value = contenders[name]()
            if r >= warmup:
                values[name].append(value)
    return values


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rss_status(key: str) -> int:
    """``VmRSS``, ``VmHWM``, ``RssAnon``... of this process, in bytes (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_rss_above_start(fn: Callable[[], object]) -> int:
    """Bytes by which this process's peak resident memory during ``fn()`` exceeded its resident
    memory just before (the kernel's high-water mark is reset first: /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    start = rss_status("VmRSS")
    fn()
    return rss_status("VmHWM") - start


@dataclass
class Path:
    """One line of a table: the values each contender gave per round, ``raw`` first."""

    name: str
    values: dict[str, list[float]]
    target: str = ""
    unit: str = "s"
    note: str = ""
    ratios: dict[str, list[float]] = field(init=False)

    def __post_init__(self):
        base = self.values["raw"]
        self.ratios = {name: [v / b if b else float("nan") for v, b in zip(vals, base)]
                       for name, vals in self.values.items()}

    def cell(self, contender: str) -> str:
        if contender not in self.values:
            return "not installed" if contender == "accelerate" else "-"
        if contender == "raw":
            return f"1.00 ({_amount(statistics.median(self.values['raw']), self.unit)})"
        ratios = self.ratios[contender]
        return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]"

    def row(self, contenders: list[str]) -> dict:
        return {"path": self.name, "cells": [self.cell(c) for c in contenders], "target": self.target,
                "note": self.note}


def _amount(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f} s" if value >= 0.01 else f"{value * 1e6:.0f} us"
    if unit == "B":
        return f"{value / 2**20:.0f} MiB"
    return f"{value:g} {unit}"


def report(title: str, paths: list[Path], *, description: str = "", rounds: int = 0) -> None:
    """Print one table (raw, Accelerate, torchbay per path) and hand it to run_all.py."""
    contenders = ["raw", "accelerate", "torchbay"]
    rows = [p.row(contenders) for p in paths]
    text = markdown_table(title, rows, contenders, description, rounds)
    print(text, flush=True)
    if os.environ.get(RESULTS_ENV):
        with open(os.environ[RESULTS_ENV], "a") as out:
            out.write(json.dumps({"title": title, "markdown": text}) + "\n")


def markdown_table(title, rows, contenders, description, rounds) -> str:
    lines = [f"### {title}", ""]
    if description:
        lines += [description.strip(), ""]
    if rounds:
        lines += [f"Median ratio to raw over {rounds} interleaved rounds, [lowest-highest] in brackets; "
                  "raw's own median in parentheses; >1 is slower or larger.", ""]
    head = ["path", *contenders, "target"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for row in rows:
        path = row["path"] + (f" ({row['note']})" if row["note"] else "")
        lines.append("| " + " | ".join([path, *row["cells"], row["target"] or "-"]) + " |")
    return "\n".join(lines) + "\n"


def machine() -> dict[str, str]:
    """The machine and the versions a result belongs to."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = ""
    try:
        memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    import torch

    import torchbay

    versions = [f"python {platform.python_version()}", f"torch {torch.__version__}",
                f"torchbay {getattr(torchbay, '__version__', '?')}"]
    if accelerate_available():
        import accelerate

        versions.append(f"accelerate {accelerate.__version__}")
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": f"{cpu}, {len(os.sched_getaffinity(0))} cores usable", "memory": memory,
            "os": f"{platform.system()} {platform.release()}", "versions": ", ".join(versions),
            "commit": commit or "?", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a benchmark's subprocess: bytecode cached as an installed package has it
    (this repository's modules compiled once, in a cache outside the tree), one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(REPO, "build", "pycache"))
    return env


def python_child(code: str, *args: str, env: dict | None = None) -> str:
    """Run ``code`` in a fresh interpreter of this venv and return its stdout (it must succeed)."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env or child_env(), cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def destroy_process_group_safely() -> None:
    """Destroy the default process group the way torchbay's teardown does.

    A group destroyed while gloo's thread drops the last reference to the final barrier's work
    can deadlock or abort (seen with torch 2.13), so that work is kept alive until after.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    last_work = dist.barrier(async_op=True)
    last_work.wait()
    dist.destroy_process_group()
    del last_work
