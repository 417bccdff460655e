"""Run by torchbay launch in tests: rank BAD misbehaves while the others wait in a barrier.

``sleep``: it never reaches the barrier; ``backward``: it never reaches backward, where the others
wait in DDP's gradient all-reduce; ``exit0``: it leaves early with exit code 0; ``exit0-before-group``:
it leaves with exit code 0 before Accelerator(), while the others wait for the process group;
``mismatch``: it enters all_gather while the others enter all_reduce. A fourth
argument sets the process-group timeout through Accelerate's ``InitProcessGroupKwargs``."""
import os
import sys
import time
from datetime import timedelta

from torchbay import Accelerator, InitProcessGroupKwargs

out_dir, mode, bad = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "exit0-before-group" and int(os.environ["RANK"]) == bad:
    sys.exit(0)
handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=float(sys.argv[4])))] if len(sys.argv) > 4 else []
acc = Accelerator(kwargs_handlers=handlers)
rank = acc.process_index
with open(os.path.join(out_dir, f"timeout{rank}"), "w") as f:
    f.write(str(acc.config.process_group_timeout_s))
acc.wait_for_everyone()  # every rank is connected


def load_my_shard():
    time.sleep(300)  # stands for a rank stuck in its own work


if mode == "backward":  # the others wait in DDP's gradient all-reduce, inside backward (C++, no Python frame)
    import torch

    model = acc.prepare(torch.nn.Linear(4, 1))
    loss = model(torch.ones(2, 4)).sum()
    if rank == bad:
        load_my_shard()
    acc.backward(loss)
def sum_losses():
    import torch

    return acc.reduce(torch.ones(4))


def collect_metrics():
    import torch

    return acc.gather(torch.ones(4))


if mode == "mismatch":
    collect_metrics() if rank == bad else sum_losses()
if rank == bad and mode == "sleep":
    load_my_shard()
if rank == bad and mode == "exit0":
    sys.exit(0)
acc.wait_for_everyone()
