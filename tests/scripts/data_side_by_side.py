"""Data-loading calls run on the real Accelerate or on torchbay (the same code, issue 36): every rank writes what
it saw (batches, lengths, gather_for_metrics, sync flags...) as JSON, and tests/data/test_data_accelerate.py
compares the two backends at 1 and 2 processes.

``python data_side_by_side.py OUT_DIR accelerate|torchbay`` (under torchrun for several processes)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, TensorDataset

out_dir, backend = sys.argv[1], sys.argv[2]
if backend == "accelerate":
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import GradientAccumulationPlugin, set_seed
else:
    from torchbay import Accelerator, DataLoaderConfiguration
    from torchbay.utils import GradientAccumulationPlugin, set_seed


class Stream(IterableDataset):
    """A streaming dataset (no length, as 🤗 datasets' streaming ones)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        yield from (torch.tensor([float(i)]) for i in range(self.n))


class SizedStream(Stream):
    def __len__(self):
        return self.n


class EpochBatches(BatchSampler):
    """A custom batch sampler whose batches vary in size and depend on the epoch it is told."""

    def __init__(self):
        self.epoch = 0

    def __iter__(self):
        sizes = [3, 2, 4, 3, 2]
        start = 0
        for size in sizes:
            yield [(start + i + self.epoch) % 14 for i in range(size)]
            start += size

    def __len__(self):
        return 5

    def set_epoch(self, epoch):
        self.epoch = epoch


def listed(loader, acc, epochs=1, gather=True):
    """Every batch of ``epochs`` epochs, with the end flag and (batches of equal sizes) gather_for_metrics of it."""
    seen = []
    for _ in range(epochs):
        for batch in loader:
            tensor = batch[0] if isinstance(batch, (list, tuple)) else batch
            row = {"batch": tensor.flatten().tolist(), "end": bool(acc.gradient_state.end_of_dataloader)}
            if gather:
                row["gathered"] = acc.gather_for_metrics(tensor).flatten().tolist()
            seen.append(row)
    return seen


def length(loader):
    try:
        return len(loader)
    except TypeError:
        return "TypeError"


def run() -> dict:
    out: dict = {}
    set_seed(42)
    acc = Accelerator(cpu=True)
    shuffled = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3, shuffle=True))
    out["is_dataloader"] = isinstance(shuffled, DataLoader)
    out["shuffled"] = listed(shuffled, acc, epochs=2)
    out["shuffled_len"] = len(shuffled)
    out["rng_after"] = torch.rand(2).tolist()  # the global stream after prepare and two epochs

    set_seed(7)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11))
    seedable = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True))
    out["seedable"] = listed(seedable, acc, epochs=2)

    for name, dataset in (("stream", Stream(11)), ("sized_stream", SizedStream(11))):
        for dispatch in (None, False):
            acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
            loader = acc.prepare(DataLoader(dataset, batch_size=2))
            out[f"{name}_dispatch_{dispatch}"] = {"len": length(loader), "batches": listed(loader, acc)}

    acc = Accelerator(cpu=True)
    custom = acc.prepare(DataLoader(TensorDataset(torch.arange(14)), batch_sampler=EpochBatches()))
    out["custom_batches"] = listed(custom, acc, gather=False)
    custom.set_epoch(1)
    out["custom_after_set_epoch"] = listed(custom, acc, gather=False)

    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=2, sync_with_dataloader=False))
    model = torch.nn.Linear(1, 1)
    model, loader = acc.prepare(model, DataLoader(TensorDataset(torch.ones(10, 1)), batch_size=1))
    syncs = []
    for _ in range(2):
        for (_x,) in loader:
            with acc.accumulate(model):
                syncs.append(acc.sync_gradients)
    out["syncs_without_dataloader_sync"] = syncs

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt, sched = acc.prepare(model, opt, sched)
    again = acc.prepare(opt, sched)
    out["prepare_again_same"] = [again[0] is opt, again[1] is sched]
    return out


result = run()
rank = int(os.environ.get("RANK", "0"))
with open(os.path.join(out_dir, f"{backend}_rank{rank}.json"), "w") as f:
    json.dump(result, f)
