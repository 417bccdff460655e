"""A tiny training job for tests/launch/test_slurm.py, run by SLURM (``srun python train.py``, or
``torchbay launch train.py`` inside an allocation).

Each rank trains a small model for a few DDP steps (gloo) on batches of its own and writes
``<out>/<tag>.rank<r>.json``: the layout torchbay saw (rank, world size, rendezvous address and
the cluster environment that gave them), the SLURM variables it ran under, the losses and the final
weights' checksum. ``--fail-rank R`` makes rank R raise at step 2, as a task with a bug would.
"""

import argparse
import json
import os
import socket

import torch

from torchbay import Accelerator

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--tag", required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--fail-rank", type=int, default=-1)
args = p.parse_args()

acc = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = acc.prepare(model, optimizer)

generator = torch.Generator().manual_seed(1234)
x = torch.randn(64, 8, generator=generator)
y = x.sum(dim=1, keepdim=True) * 0.5
per_rank = 64 // acc.num_processes
shard = slice(acc.process_index * per_rank, (acc.process_index + 1) * per_rank)
losses = []
for step in range(args.steps):
    if step == 2 and acc.process_index == args.fail_rank:
        raise RuntimeError(f"deliberate failure on rank {acc.process_index} at step {step}")
    loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(acc.reduce(loss.detach(), "mean").item())

import torch.distributed as dist  # noqa: E402

cluster = acc.context.cluster
weights = sum(float(t.double().sum()) for t in acc.unwrap_model(model).state_dict().values())
result = {
    "rank": acc.process_index, "world": acc.num_processes, "local_rank": acc.local_process_index,
    "cluster": cluster.name, "main_address": cluster.main_address(), "main_port": cluster.main_port(),
    "MASTER_ADDR": os.environ.get("MASTER_ADDR"), "MASTER_PORT": os.environ.get("MASTER_PORT"),
    "backend": dist.get_backend() if dist.is_initialized() else None,
    "slurm": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
    "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,
    "pid": os.getpid(), "host": socket.gethostname(), "losses": losses, "weights": weights,
}
with open(os.path.join(args.out, f"{args.tag}.rank{acc.process_index}.json"), "w") as fp:
    json.dump(result, fp)
print(f"TRAINED rank {acc.process_index}/{acc.num_processes} loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
acc.end_training()
