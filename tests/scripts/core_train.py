"""Worker for the core tests: a small regression trained through the public API.

--phase full   : train --steps optimizer steps, write weights and batch order
--phase first  : train --stop-at steps, save_state(--ckpt), write batch order so far
--phase resume : load_state(--ckpt) and finish to --steps, write weights and batch order
"""

import argparse
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

from torchbay import Accelerator, DataLoaderConfiguration, set_seed

p = argparse.ArgumentParser()
p.add_argument("--phase", default="full", choices=["full", "first", "resume"])
p.add_argument("--steps", type=int, default=12, help="micro-batches in total")
p.add_argument("--stop-at", type=int, default=5)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--ga", type=int, default=1)
p.add_argument("--split-batches", action="store_true")
p.add_argument("--seedable-sampler", action="store_true", help="the same global order at any number of processes")
p.add_argument("--ckpt", default="")
p.add_argument("--out", required=True)
p.add_argument("--mixed-precision", default="no")
p.add_argument("--dropout", type=float, default=0.0, help="> 0 makes training draw from the global RNG")
args = p.parse_args()


class Progress:
    def __init__(self):
        self.micro_batches = 0

    def state_dict(self):
        return {"micro_batches": self.micro_batches}

    def load_state_dict(self, state):
        self.micro_batches = state["micro_batches"]


accelerator = Accelerator(gradient_accumulation_steps=args.ga, mixed_precision=args.mixed_precision,
                          dataloader_config=DataLoaderConfiguration(split_batches=args.split_batches,
                                                                    use_seedable_sampler=args.seedable_sampler))
set_seed(1234)
n = 40
x = torch.randn(n, 8)
y = x @ torch.randn(8, 1) + 0.1 * torch.randn(n, 1)
dataset = TensorDataset(torch.arange(n), x, y)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(args.dropout),
                            torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
progress = Progress()
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
accelerator.register_for_checkpointing(progress)

if args.phase == "resume":
    accelerator.load_state(args.ckpt)
start_epoch, skip = divmod(progress.micro_batches, len(loader))
seen = []
done = False
for epoch in range(start_epoch, 100):
    epoch_loader = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
    for idx, xb, yb in epoch_loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seen.append(idx.tolist())
        progress.micro_batches += 1
        if args.phase == "first" and progress.micro_batches == args.stop_at:
            accelerator.save_state(args.ckpt)
            done = True
            break
        if progress.micro_batches == args.steps:
            done = True
            break
    if done:
        break

weights = {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
rank = accelerator.process_index
with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump({"seen": seen, "weights": weights, "world": accelerator.num_processes,
               "strategy": accelerator.strategy.name}, f)
accelerator.end_training()
