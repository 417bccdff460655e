"""Accelerate-compat behaviours that need 2 processes; writes <out>/result_rank<r>.json per rank."""

import json
import logging
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from torchbay import (
    Accelerator,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    PartialState,
)
from torchbay.utils import broadcast, gather, get_logger, pad_across_processes, reduce

out_dir = sys.argv[1]
results = {}
state = PartialState()
rank = state.process_index

# free functions with Accelerate's signatures
t = torch.tensor([1.0 + rank, 2.0 + rank])
results["gather"] = gather(t).tolist()
results["reduce_sum"] = reduce(t, "sum").tolist()
results["reduce_mean_default"] = reduce(t).tolist()
results["broadcast"] = broadcast(t.clone(), from_process=1).tolist()
results["pad"] = pad_across_processes(torch.ones(1 + rank), pad_index=-1).tolist()

# get_logger(in_order=True): every rank's message, in rank order, call by call
log_path = os.path.join(out_dir, "ordered.log")
handler = logging.FileHandler(log_path)
logger = get_logger("compat.ordered", log_level="INFO")
logger.logger.addHandler(handler)
for call in range(3):
    logger.info(f"call {call} rank {rank}", main_process_only=False, in_order=True)
handler.close()


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4) * (rank + 1)  # different data on each rank
    return model, x


def grads_equal_across_ranks(model):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    both = gather(flat[None])
    return bool(torch.allclose(both[0], both[1]))


# sync_each_batch: gradients are reduced on every micro-batch, the optimizer steps every num_steps
for each in (False, True):
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=each))
    model, x = model_and_data()
    model = acc.prepare(model)
    with acc.accumulate(model):
        acc.backward(model(x).pow(2).mean())
    results[f"synced_first_micro_batch_sync_each_batch={each}"] = grads_equal_across_ranks(acc.unwrap_model(model))

# trigger_sync_in_backward inside no_sync
acc = Accelerator()
model, x = model_and_data()
model = acc.prepare(model)
with acc.no_sync(model):
    with acc.trigger_sync_in_backward(model):
        acc.backward(model(x).pow(2).mean())
results["trigger_sync_in_backward"] = grads_equal_across_ranks(acc.unwrap_model(model))

# join_uneven_inputs: rank 0 has 2 batches, rank 1 has 1; no hang
acc = Accelerator(dataloader_config=__import__("torchbay").DataLoaderConfiguration(even_batches=False))
model = acc.prepare(torch.nn.Linear(1, 1))
loader = acc.prepare(DataLoader(TensorDataset(torch.arange(3.0)[:, None]), batch_size=1))
seen = 0
with acc.join_uneven_inputs([model]):
    for (xb,) in loader:
        model(xb).sum().backward()
        seen += 1
results["join_batches"] = seen
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with acc.join_uneven_inputs([torch.nn.Linear(1, 1)]):
        pass
results["join_warns_for_non_ddp"] = any("only supported" in str(w.message) for w in caught)

# DDP communication hooks on gloo: gradients close to plain DDP's
reference = None
for hook in (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.POWER_SGD):
    acc = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=hook)])
    model, x = model_and_data()
    model = acc.prepare(model)
    model(x).pow(2).mean().backward()
    grad = acc.unwrap_model(model).weight.grad.clone()
    reference = grad if reference is None else reference
    results[f"hook_{hook.value}"] = bool(torch.allclose(grad, reference, rtol=1e-2, atol=1e-2))

with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w") as f:  # two ranks' prints can interleave
    json.dump({"rank": rank, **results}, f)
