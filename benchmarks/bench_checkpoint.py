"""save_state / load_state beside plain safetensors + torch.save (and Accelerate) on the same
model and AdamW state.

- raw: ``safetensors.torch.save_file(model.state_dict())`` + ``torch.save(optimizer.state_dict())``
  (no fsync); load: ``model.load_state_dict(load_file(...))`` +
  ``optimizer.load_state_dict(torch.load(..., weights_only=True))``;
- accelerate (when installed): ``accelerate.Accelerator().save_state`` / ``load_state`` on the
  model and optimizer it prepared;
- torchbay: ``Accelerator().save_state`` / ``load_state``: written under ``<dir>.partial``,
  every file fsync'ed and recorded with its xxh3-128 checksum in the manifest, published with a
  rename; load verifies every checksum before anything is restored.

Times are measured in this process, in interleaved rounds; every save starts with the page
cache written back (``os.sync()``, not timed), into a new directory. Peak memory of a load is
measured in a fresh interpreter per contender and round (build, prepare, ``gc.collect()``, then
the high-water mark of resident memory above the start during the load), so that no contender
pays for another's garbage. Before every load the weights and optimizer state are changed;
after it they must equal what was saved, bit for bit (the benchmark stops if not).

Asynchronous tables come first: a 24-step loop with a save every 6 steps, synchronous saves
against ``save_state(blocking=False)`` (the stall inside the call, and the time each adds to the loop),
with 1 process (``--async-mb``) and with FSDP2 over 2 processes and over 1 (half that size; on a 2-core machine
the 2 processes leave a background writer no core of its own, the 1 leaves it one; launched here through
torch.distributed.run, or by hand as below).

    python benchmarks/bench_checkpoint.py [--mb 200] [--rounds 7] [--memory-rounds 3]
                                          [--async-mb 100] [--async-rounds 3] [--only sync|async]
    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py --async-strategy fsdp [--async-mb 100]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RESULTS_ENV,
    Path,
    accelerate_available,
    interleaved,
    peak_rss_above_start,
    python_child,
    report,
    timed,
)

WIDTH = 1024


def build(mb: int):
    """A stack of Linear(1024) of about ``mb`` MiB and its AdamW after one step (state: 2x the model)."""
    layers = max(1, int(mb * 2**20 / 4 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    return model, optimizer


def tensors_of(model, optimizer) -> list[torch.Tensor]:
    """Every tensor a load restores: the weights, then each optimizer state tensor."""
    out = [p.detach() for p in model.parameters()]
    opt = getattr(optimizer, "optimizer", optimizer)  # Accelerate's and torchbay's wrappers
    for group in opt.param_groups:
        for p in group["params"]:
            out += [v for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


def fingerprint(model, optimizer) -> str:
    digest = hashlib.sha256()
    for t in tensors_of(model, optimizer):
        digest.update(t.contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def perturb(model, optimizer) -> None:
    """Change every restored value, so that a load that restores nothing is caught."""
    with torch.no_grad():
        for t in tensors_of(model, optimizer):
            t.add_(1)


# --- the contenders --------------------------------------------------------------------------


def raw_save(model, optimizer, directory: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory)
    save_file(model.state_dict(), os.path.join(directory, "model.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))


def raw_load(model, optimizer, directory: str) -> None:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")))
    optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True))


def prepared(contender: str, mb: int, **config):
    """(model, optimizer, accelerator) for ``contender``, built from the same seed."""
    model, optimizer = build(mb)
    if contender == "raw":
        return model, optimizer, None
    if contender == "accelerate":
        import accelerate

        acc = accelerate.Accelerator(cpu=True)
    else:
        from torchbay import Accelerator

        acc = Accelerator(config=config) if config else Accelerator()
    model, optimizer = acc.prepare(model, optimizer)
    return model, optimizer, acc


def save(contender, model, optimizer, acc, directory):
    if contender == "raw":
        raw_save(model, optimizer, directory)
    else:
        acc.save_state(directory)


def load(contender, model, optimizer, acc, directory):
    if contender == "raw":
        raw_load(model, optimizer, directory)
    else:
        acc.load_state(directory)


def child(contender: str, mb: str, directory: str, expected: str) -> None:
    """One load in this fresh interpreter: prints its peak resident memory above the start."""
    torch.set_num_threads(1)
    model, optimizer, acc = prepared(contender, int(mb))
    perturb(model, optimizer)
    gc.collect()
    peak = peak_rss_above_start(lambda: load(contender, model, optimizer, acc, directory))
    if fingerprint(model, optimizer) != expected:
        raise SystemExit(f"{contender}: after load_state the weights or optimizer state differ from what was saved")
    print(json.dumps({"peak": peak}))


def async_table(mb: int, rounds: int, steps: int = 24, every: int = 6, strategy: str = "single") -> None:
    """A training loop of ``steps`` steps with a save every ``every``: no save, synchronous saves,
    ``save_state(blocking=False)``, in turn on one prepared model. Per save, the time inside the
    call (the stall); per loop, the time added to the no-save loop, the last save waited for
    (published) inside the loop's time. ``strategy="fsdp"``: run under torchrun (FSDP2, every
    rank runs the loop; rank 0 reports, its folder shared)."""
    from torchbay import Accelerator

    acc = Accelerator(strategy=strategy) if strategy != "single" else Accelerator()
    base_dir = os.environ.get("BENCH_DIR") or tempfile.gettempdir()
    work = acc.strategy.broadcast_object(tempfile.mkdtemp(prefix="bench_checkpoint_async_", dir=base_dir)
                                         if acc.is_main_process else None) if acc.num_processes > 1 else \
        tempfile.mkdtemp(prefix="bench_checkpoint_async_", dir=base_dir)
    variants = ("no save", "sync save", "async save")
    if strategy == "single":
        model, optimizer = build(mb)
    else:  # prepared before the first step: the optimizer's state is created on the shards
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(max(1, int(
            mb * 2**20 / 4 / (WIDTH * WIDTH + WIDTH))))])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mb_of_model = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    world = acc.num_processes
    model, optimizer = acc.prepare(model, optimizer)
    objects = {name: (model, optimizer, acc) for name in variants}
    batch = torch.randn(16, WIDTH)
    stalls: dict[str, list[float]] = {n: [] for n in variants}
    loops: dict[str, list[float]] = {n: [] for n in variants}

    def loop(name: str) -> None:
        model, optimizer, acc = objects[name]
        os.sync()
        handle = None
        start = time.perf_counter()
        for i in range(1, steps + 1):
            acc.backward(model(batch).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if i % every == 0 and name != "no save":
                directory = os.path.join(work, f"{name.split()[0]}_{(i // every) % 2}")
                call = time.perf_counter()
                handle = acc.save_state(directory, blocking=name == "sync save")
                stalls[name].append(time.perf_counter() - call)
        if handle is not None and not isinstance(handle, str):
            handle.wait()  # the loop ends with its last checkpoint published
        loops[name].append(time.perf_counter() - start)

    try:
        for name in variants:  # warm-up: page cache, allocator, the staging buffer's first allocation
            loop(name)
        for name in variants:
            stalls[name].clear()
            loops[name].clear()
        for _ in range(rounds):
            for name in variants:
                loop(name)
    finally:
        acc.end_training()
        if acc.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
    if not acc.is_main_process:
        return

    base = statistics.median(loops["no save"])
    added = {n: statistics.median(loops[n]) - base for n in variants[1:]}
    stall = {n: statistics.median(stalls[n]) for n in variants[1:]}
    size = mb_of_model
    processes = f"{world} process" + ("es" if world > 1 else "")
    where = processes if strategy == "single" else f"{strategy}, {processes} (rank 0's times)"
    cores = os.cpu_count() or 1
    room = (f"the {world} processes take all {cores} cores: a background writer can only run on time it takes from "
            f"the loop" if world >= cores else
            f"{cores - world} of the {cores} cores free for the background writer")
    lines = [f"### Checkpoints: asynchronous save_state (blocking=False), {strategy}, {processes}", "",
             f"Model {size:.0f} MiB (Linear({WIDTH}) layers) + AdamW state {2 * size:.0f} MiB, {where}, 1 thread; "
             f"{room}. {steps} steps with a save every {every}, into two folders in turn (each save replaces a "
             f"checkpoint); the loop's time includes waiting for its last save to be published. Medians over "
             f"{rounds} interleaved rounds after one warm-up round.", "",
             "| path | sync save | async save | async / sync | target |", "|---|---|---|---|---|",
             f"| time inside the save call (stall) | {stall['sync save']:.3f} s | {stall['async save']:.3f} s | "
             f"{stall['async save'] / stall['sync save']:.2f}x | <= 0.25x |",
             f"| loop time added to {base:.2f} s without saves | {added['sync save']:.3f} s | "
             f"{added['async save']:.3f} s | {added['async save'] / added['sync save']:.2f}x | <= 0.50x |", ""]
    text = "\n".join(lines)
    print(text, flush=True)
    if os.environ.get(RESULTS_ENV):
        with open(os.environ[RESULTS_ENV], "a") as out:
            out.write(json.dumps({"title": "Checkpoints: asynchronous save_state", "markdown": text}) + "\n")


def fsdp_async_table(mb: int, rounds: int, processes: int) -> None:
    """The asynchronous table again for FSDP2 with ``processes`` processes, launched by torch.distributed.run (rank 0
    adds its table to the same results file)."""
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               os.path.abspath(__file__), "--async-strategy", "fsdp", "--async-mb", str(mb),
               "--async-rounds", str(rounds)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(command, check=True, env=env)


CHILD = "import sys; sys.path.insert(0, 'benchmarks'); import bench_checkpoint as b; b.child(*sys.argv[1:])"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200, help="model size; AdamW state is twice that")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of save and load")
    parser.add_argument("--memory-rounds", type=int, default=3, help="rounds of fresh-process loads")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first (a VM's page cache "
                        "is slow to write into memory it has never touched)")
    parser.add_argument("--async-mb", type=int, default=100, help="model size of the asynchronous-save table")
    parser.add_argument("--async-rounds", type=int, default=3, help="rounds of the asynchronous-save table")
    parser.add_argument("--only", choices=("sync", "async"), help="only one of the tables")
    parser.add_argument("--async-strategy", default="single", choices=("single", "fsdp"),
                        help="fsdp: the asynchronous table only, under torchrun (--nproc-per-node 1 or 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.async_strategy != "single":
        async_table(args.async_mb, args.async_rounds, strategy=args.async_strategy)
        return
    if args.only != "sync":
        async_table(args.async_mb, args.async_rounds)
        for processes in (2, 1):  # 2 processes take both cores of a 2-core machine; 1 leaves the writer a core
            fsdp_async_table(args.async_mb // 2, args.async_rounds, processes)
    if args.only == "async":
        return
    names = ["raw"] + (["accelerate"] if accelerate_available() else []) + ["torchbay"]
    objects = {name: prepared(name, args.mb) for name in names}
    # the same prepared objects, loaded without the checksum verification
    from torchbay import Accelerator

    unverified = Accelerator(config={"checkpoint": {"verify": False}})
    tb_model, tb_optimizer, tb_acc = objects["torchbay"]
    unverified._models, unverified._optimizers = tb_acc._models, tb_acc._optimizers
    expected = fingerprint(*objects["raw"][:2])
    assert all(fingerprint(*objects[n][:2]) == expected for n in names), "contenders built different models"

    work = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=os.environ.get("BENCH_DIR"))
    latest: dict[str, str] = {}
    counter = [0]

    def saver(name):
        def run() -> float:
            old = latest.get(name)
            counter[0] += 1
            latest[name] = os.path.join(work, f"{name}_{counter[0]}")
            if old:
                shutil.rmtree(old)  # the benchmark's own scratch directory
            os.sync()
            return timed(lambda: save(name, *objects[name], latest[name]))
        return run

    def loader(name, directory_of=None, objs=None):
        def run() -> float:
            model, optimizer, acc = objs or objects[name]
            perturb(model, optimizer)
            seconds = timed(lambda: load(name, model, optimizer, acc, latest[directory_of or name]))
            if fingerprint(model, optimizer) != expected:
                raise SystemExit(f"{name}: after load_state the weights or optimizer state differ from what was saved")
            return seconds
        return run

    try:
        synced = []

        def raw_fsync() -> float:
            directory = os.path.join(work, "raw_fsync")
            shutil.rmtree(directory, ignore_errors=True)
            os.sync()

            def run():
                raw_save(*objects["raw"][:2], directory)
                for name in ("model.safetensors", "optimizer.pt"):
                    with open(os.path.join(directory, name), "rb") as f:
                        os.fsync(f.fileno())
            synced.append(timed(run))
            return synced[-1]

        saves = interleaved({**{n: saver(n) for n in names}, "raw+fsync": raw_fsync}, args.rounds, args.warmup)
        synced_ratio = statistics.median(s / r for s, r in zip(saves.pop("raw+fsync"), saves["raw"]))
        loads = interleaved({**{n: loader(n) for n in names},
                             "verify off": loader("torchbay", "torchbay", (tb_model, tb_optimizer, unverified))},
                            args.rounds, 1)
        unverified_loads = loads.pop("verify off")

        def in_child(name):
            def run() -> float:
                out = python_child(CHILD, name, str(args.mb), latest[name], expected)
                return float(json.loads(out.strip().splitlines()[-1])["peak"])
            return run

        peaks = interleaved({n: in_child(n) for n in names}, args.memory_rounds, 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    size = sum(p.numel() for p in objects["raw"][0].parameters()) * 4 / 2**20
    paths = [
        Path("save_state time", saves, target="<= 1.00x"),
        Path("load_state time", loads, target="<= 1.00x"),
        Path("load_state time, torchbay with checkpoint.verify: false", {**loads, "torchbay": unverified_loads},
             note="Accelerate never verifies"),
        Path("load_state peak memory above the start", peaks, target="<= 1.00x", unit="B",
             note=f"a fresh process per load, {args.memory_rounds} rounds"),
    ]
    description = (f"Model {size:.0f} MiB (Linear({WIDTH}) layers) + AdamW state {2 * size:.0f} MiB, 1 thread. "
                   f"torchbay fsyncs every file it writes; raw with an fsync of both files took "
                   f"{synced_ratio:.2f}x raw on this disk. Weights and optimizer state after every load are "
                   f"bit-identical to what was saved (checked).")
    report("Checkpoints: save_state / load_state", paths, description=description, rounds=args.rounds)


if __name__ == "__main__":
    main()
