"""Worker for the checkpoint tests (1, 2 or 4 processes under torchrun, or plain python).

--mode roundtrip : train, save_state, train on, load_state; the weights must be the saved ones
--mode save      : train and save_state (the test then damages or forges the files)
--mode load      : load_state; write the error each rank saw ("" when it loaded)
Writes <out>/result_rank<r>.json.
"""

import argparse
import json
import os

import torch

from torchbay import Accelerator, CheckpointError

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["roundtrip", "save", "load"], required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--out", required=True)
p.add_argument("--io", default="safetensors")
p.add_argument("--strategy", default="auto")
p.add_argument("--rank-precision-state", action="store_true", help="the precision keeps per-rank state")
args = p.parse_args()

config = {"checkpoint": {"io": args.io}}
if args.strategy == "deepspeed":
    config["deepspeed"] = {"zero_stage": 2}
acc = Accelerator(strategy=args.strategy, config=config)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
model, optimizer = acc.prepare(model, optimizer)
restored_rank_states = []
if args.rank_precision_state:  # as an FP8 engine's scaling history: different on every rank
    acc.precision.rank_state_dict = lambda: {"history": torch.full((3,), float(acc.process_index))}
    acc.precision.load_rank_state_dict = restored_rank_states.append


def train(steps):
    for i in range(steps):
        torch.manual_seed(100 + i + acc.process_index)
        acc.backward(model(torch.randn(4, 6)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


def weights():
    return {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}


result = {"rank": acc.process_index, "world": acc.num_processes}
if args.mode in ("roundtrip", "save"):
    train(2)
    saved = weights()
    acc.save_state(args.ckpt)
    result["files"] = sorted(json.load(open(os.path.join(args.ckpt, "torchbay_manifest.json")))["files"])
if args.mode == "roundtrip":
    train(2)
    moved = weights()
    acc.load_state(args.ckpt)
    loaded = weights()
    if acc.is_main_process:
        result["moved"] = max((moved[k] - saved[k]).abs().max().item() for k in saved)
        result["after_load"] = max((loaded[k] - saved[k]).abs().max().item() for k in saved)
    train(1)  # training goes on after the load
if args.mode == "load":
    try:
        acc.load_state(args.ckpt)
        result["error"] = ""
        result["rank_precision_state"] = [s["history"].tolist() if s else None for s in restored_rank_states]
    except CheckpointError as exc:
        result["error"] = str(exc)
with open(os.path.join(args.out, f"result_rank{acc.process_index}.json"), "w") as f:
    json.dump(result, f)
acc.end_training()
