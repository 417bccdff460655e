"""The short real training ``torchbay test`` runs in every process of the configured set-up.

Run by ``torchbay launch`` machinery as a script; each check is run on every rank, its
result gathered, and rank 0 prints PASS/FAIL per check. The exit code is non-zero when a
check failed on any rank.
"""

from __future__ import annotations

import shutil
import sys
import time
import traceback
import uuid
from pathlib import Path


def main() -> int:
    import torch
    from torch.utils.data import DataLoader

    from torchbay import Accelerator

    results: list[tuple[str, bool, str]] = []

    def check(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        results.append((name, bool(ok), f"{detail} ({(time.perf_counter() - start) * 1000:.0f} ms)"))

    acc = Accelerator()
    world, rank = acc.num_processes, acc.process_index

    def process_group():
        import torch.distributed as dist

        if world == 1:
            return True, "one process: no process group needed"
        ok = dist.is_initialized() and dist.get_world_size() == world and dist.get_rank() == rank
        return ok, f"rank {rank} of {world}, backend {dist.get_backend() if dist.is_initialized() else 'none'}"

    def collectives():
        total = acc.reduce(torch.tensor([float(rank + 1)], device=acc.device), "sum").item()
        gathered = acc.gather(torch.tensor([rank], device=acc.device)).cpu().tolist()
        token = acc.strategy.broadcast_object(f"from-rank-0-{world}")
        expected = world * (world + 1) / 2
        ok = total == expected and gathered == list(range(world)) and token == f"from-rank-0-{world}"
        return ok, (f"all_reduce {total} (expected {expected}), all_gather {gathered}, "
                    f"broadcast ok={token.endswith(str(world))}")

    def data_sharding():
        n = 8 * world
        loader = acc.prepare(DataLoader(list(range(n)), batch_size=2, shuffle=False))
        mine = [int(x) for batch in loader for x in batch.tolist()]
        everyone = acc.strategy.all_gather_object(mine)
        flat = sorted(x for part in everyone for x in part)
        disjoint = sum(len(p) for p in everyone) == len(set(flat))
        ok = flat == list(range(n)) and disjoint
        return ok, (f"{len(mine)} of {n} samples on this rank, shards disjoint={disjoint}, "
                    f"cover all={flat == list(range(n))}")

    state: dict = {}

    def optimizer_step():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = acc.prepare(model, optimizer)
        before = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
        torch.manual_seed(1 + rank)
        x = torch.randn(4, 8, device=acc.device)
        loss = model(x).float().pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        after = [p.detach() for p in acc.unwrap_model(model).parameters()]
        changed = any(not torch.equal(a, b) for a, b in zip(before, after))
        checksum = float(sum(p.double().sum() for p in after))
        sums = acc.strategy.all_gather_object(round(checksum, 6))
        same = all(abs(s - sums[0]) < 1e-4 for s in sums)
        state.update(model=model, optimizer=optimizer)
        return changed and same, f"loss {loss.item():.4f}, parameters changed={changed}, identical on all ranks={same}"

    def save_load():
        model = state["model"]
        name = acc.strategy.broadcast_object(f".torchbay_test_{uuid.uuid4().hex[:8]}")
        directory = Path(name)
        acc.save_state(str(directory))
        saved = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
        with torch.no_grad():
            for p in acc.unwrap_model(model).parameters():
                p.add_(1.0)
        acc.load_state(str(directory))
        restored = all(torch.equal(a, b.detach()) for a, b in zip(saved, acc.unwrap_model(model).parameters()))
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(directory, ignore_errors=True)
        return restored, f"save_state/load_state through {directory}: weights restored={restored}"

    check("process group", process_group)
    check("collectives", collectives)
    check("data sharding", data_sharding)
    check("one optimizer step", optimizer_step)
    if "model" in state:
        check("save/load round trip", save_load)
    else:
        results.append(("save/load round trip", False, "skipped: the optimizer step failed"))

    everyone = acc.strategy.all_gather_object(results) if world > 1 else [results]
    failed = 0
    if acc.is_main_process:
        print(f"torchbay test: {world} process(es), device {acc.device_backend.name}, strategy {acc.strategy.name}, "
              f"mixed_precision {acc.mixed_precision}")
        for index, (name, _, _) in enumerate(results):
            per_rank = [r[index] for r in everyone]
            ok = all(r[1] for r in per_rank)
            failed += not ok
            print(f"  {'PASS' if ok else 'FAIL'}  {name}: {per_rank[0][2]}")
            for other_rank, r in enumerate(per_rank):
                if not r[1]:
                    print(f"        rank {other_rank}: {r[2]}")
        print("torchbay test: " + ("all checks passed" if not failed else f"{failed} check(s) failed"), flush=True)
    failed = int(acc.strategy.broadcast_object(failed)) if world > 1 else failed
    acc.end_training()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
