"""Trained by ``torchbay launch`` in the multi-machine and restart tests.

Each optimizer step uses a global batch drawn from the step number (so any layout of the same
world size sees the same data), each rank its slice; a checkpoint is saved after every step
with automatic naming, and a restarted job resumes from the newest one with ``load_state()``.

usage: cli_elastic.py OUT_DIR STEPS [--stall-rank R --stall-after S]
With --stall-*, rank R of the first attempt writes OUT_DIR/stalled after step S and waits to be
killed (the test SIGKILLs it); the other ranks block in the next step's collective.
"""
import argparse
import json
import os
import time

import torch

from torchbay import Accelerator, CheckpointError, ProjectConfiguration, set_seed

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("steps", type=int)
p.add_argument("--stall-rank", type=int, default=-1)
p.add_argument("--stall-after", type=int, default=-1)
args = p.parse_args()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Progress:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


acc = Accelerator(project_config=ProjectConfiguration(project_dir=os.path.join(args.out, "project"),
                                                      automatic_checkpoint_naming=True, total_limit=2))
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
model, optimizer = acc.prepare(model, optimizer)
progress = Progress()
acc.register_for_checkpointing(progress)
try:
    resumed = str(acc.load_state())  # the newest automatic checkpoint
except CheckpointError:
    if attempt:
        raise
    resumed = ""
world, rank = acc.num_processes, acc.process_index
per_rank = 16 // world
while progress.step < args.steps:
    g = torch.Generator().manual_seed(1000 + progress.step)
    x, w = torch.randn(16, 8, generator=g), torch.randn(8, 1, generator=g)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    loss = torch.nn.functional.mse_loss(model(x[mine]), (x @ w)[mine])
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    progress.step += 1
    acc.save_state()
    if attempt == 0 and rank == args.stall_rank and progress.step == args.stall_after:
        with open(os.path.join(args.out, "stalled"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)  # killed here
if rank == 0:
    weights = {k: v.detach().cpu().tolist() for k, v in acc.unwrap_model(model).state_dict().items()}
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({"world": world, "attempt": attempt, "resumed": resumed, "weights": weights}, f)
