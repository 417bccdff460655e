"""DDP training step in 2 processes (gloo, 1 thread each): raw PyTorch, Accelerate and torchbay.

Every contender is started the same way (torch.distributed.run, so the launchers are not
compared here: see bench_launcher.py) and times only its training loop, between two
barriers: 3 x Linear(256), batch 32 per process, AdamW. The raw loop is what a user writes
by hand: ``DistributedDataParallel`` and every other batch of one DataLoader per rank (the
split Accelerate and torchbay make), so all three train on the same batches and must end
with bit-identical weights (the benchmark stops if torchbay's differ).

    python benchmarks/bench_ddp.py [--steps 300] [--rounds 5] [--nproc 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def worker(contender: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from bench_core import make_loader, make_model
    from common import destroy_process_group_safely

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    model, opt = make_model(256)
    loader = make_loader(steps * world, 256)
    if contender == "raw":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = torch.nn.parallel.DistributedDataParallel(model)
        batches = (b for i, b in enumerate(loader) if i % world == rank)
        backward, barrier = (lambda loss: loss.backward()), dist.barrier
    else:
        if contender == "accelerate":
            from accelerate import Accelerator
        else:
            from torchbay import Accelerator
        acc = Accelerator(cpu=True)
        model, opt, batches = acc.prepare(model, opt, loader)
        backward, barrier = acc.backward, acc.wait_for_everyone
    barrier()
    start = time.perf_counter()
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss)
        opt.step()
        opt.zero_grad()
    barrier()
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"seconds": seconds, "digest": digest}), flush=True)
    if contender == "torchbay":
        acc.end_training()  # its own teardown
        return
    if contender == "accelerate":  # it destroys the group itself: keep the last work alive past that
        last_work = dist.barrier(async_op=True)  # (see common.destroy_process_group_safely)
        last_work.wait()
        acc.end_training()
        del last_work
    del model, opt
    destroy_process_group_safely()


def launch(contender: str, steps: int, nproc: int) -> dict:
    from common import child_env

    env = child_env()
    for key in [k for k in env if k.startswith(("TORCHBAY_", "ACCELERATE_"))]:
        env.pop(key)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           "--standalone", os.path.abspath(__file__), "--worker", contender, "--steps", str(steps)],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{contender} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="steps per process")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    from common import Path, accelerate_available, interleaved, report

    contenders = ["raw", "torchbay"] + (["accelerate"] if accelerate_available() else [])
    digests: dict[str, set[str]] = {c: set() for c in contenders}

    def run(contender):
        def once():
            result = launch(contender, args.steps, args.nproc)
            digests[contender].add(result["digest"])
            return result["seconds"]
        return once

    values = interleaved({c: run(c) for c in contenders}, args.rounds)
    if digests["torchbay"] != digests["raw"] or len(digests["raw"]) != 1:
        raise SystemExit(f"torchbay's weights after {args.steps} DDP steps differ from the raw loop's: {digests}")
    note = ("Accelerate's weights differ from raw's"
            if digests.get("accelerate", digests["raw"]) != digests["raw"] else "")
    report(f"DDP training step, {args.nproc} processes, gloo", [
        Path(f"DDP step, {args.nproc} processes, small MLP", values, target="<= 1.02x", note=note)],
        rounds=args.rounds,
        description=f"{args.steps} steps per process, timed between barriers inside each job (the same launcher for "
                    "all); weights after the loop are bit-identical to the raw loop's (checked every round).")


if __name__ == "__main__":
    main()
