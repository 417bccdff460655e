"""save_state(blocking=False) with the sharded strategies, and a save that cannot start on one rank (2 processes,
gloo, CPU). Writes ``result_rank<r>.json`` into ``--out``.

Modes (``--strategy ddp|fsdp|fsdp1``; fsdp1 is FSDP1, ``fsdp.version: 1``):
  state       async save, train on while it is written, wait, load: the checkpoint is the state at the call
  reuse       two async saves, training between them: the second stages into the host memory of the first
              (same data pointers, none of them a live tensor's) and each checkpoint loads as the state at its call
  start_fail  the state cannot be taken on rank 1 only (``--inject extra``: a plugin's per-rank extra state
              raises there; ``--inject model``: a hook on the prepared model's state dict raises there): every
              rank gets the error, nothing is published, no writer is left running, and the next asynchronous
              save works

torchbay refuses FSDP1 on CPU (its check asks for an accelerator); torch runs it over gloo, and these tests lift
that one check in this process to run real FSDP1 here.
"""

import argparse
import json
import logging
import os
import threading

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--mode", required=True, choices=["state", "reuse", "start_fail"])
parser.add_argument("--strategy", required=True, choices=["ddp", "fsdp", "fsdp1"])
parser.add_argument("--inject", default="model", choices=["extra", "model"])
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from torchbay import Accelerator, CheckpointError  # noqa: E402
from torchbay.errors import TorchbayError  # noqa: E402
from torchbay.plugin import hookimpl  # noqa: E402
from torchbay.registry.manager import get_plugin_manager  # noqa: E402
from torchbay.storage import publish as ckdir  # noqa: E402

ARMED = threading.Event()  # the injected failure fires (on rank 1) while set
RANK = int(os.environ.get("RANK", "0"))
INJECTED = "state cannot be taken (injected on rank 1)"


class FailingExtra:
    """A plugin whose per-rank extra state cannot be taken on rank 1 while armed."""

    @hookimpl
    def torchbay_state_extra(self, context):
        if ARMED.is_set() and RANK == 1 and args.inject == "extra":
            raise TorchbayError(INJECTED)  # a TorchbayError: a plugin's other errors only disable the plugin
        return None


def refuse_on_rank_1(module, state_dict, prefix, local_metadata):
    """A state-dict hook of the prepared model: its state cannot be taken on rank 1 while armed (after FSDP's own
    hooks: an error inside FSDP1's state dict would leave its parameters gathered, which torch does not undo)."""
    if ARMED.is_set() and RANK == 1 and args.inject == "model":
        raise RuntimeError(INJECTED)


messages: list[str] = []


class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())


logging.getLogger("torchbay").addHandler(Keep())
get_plugin_manager().register_plugin(FailingExtra(), "failing_extra")
if args.strategy == "fsdp1":
    from torchbay_fsdp.strategy import FSDPStrategy

    check = FSDPStrategy.check.__func__
    FSDPStrategy.check = classmethod(lambda cls, context: [p for p in check(cls, context)
                                                           if "needs an accelerator" not in p])
    acc = Accelerator(strategy="fsdp", config={"fsdp": {"version": 1}})
else:
    acc = Accelerator(strategy=args.strategy)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
model.register_state_dict_post_hook(refuse_on_rank_1)
full = StateDictOptions(full_state_dict=True)


def train(steps):
    for _ in range(steps):
        acc.backward(model(torch.randn(8, 32)).pow(2).mean())
        opt.step()
        opt.zero_grad()


def snapshot():  # the full state on every rank (collectives: every rank, main thread)
    def plain(value):
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    weights = {k: plain(v).clone() for k, v in get_model_state_dict(model, options=full).items()}
    optim = get_optimizer_state_dict(model, getattr(opt, "optimizer", opt), options=full)["state"]
    return weights, {(name, k): plain(v).clone() for name, s in optim.items() for k, v in s.items()
                     if torch.is_tensor(v)}


def same(expected) -> bool:
    now = snapshot()
    return all(now[i].keys() == expected[i].keys() and all(torch.equal(now[i][k], expected[i][k]) for k in now[i])
               for i in range(2))


def saved_as_at_the_call(name: str) -> dict:
    expected = snapshot()
    handle = acc.save_state(os.path.join(args.ckpt, name), blocking=False)
    done_at_return = handle.done()
    train(3)  # every weight and optimizer state changes while the save is written
    changed = not same(expected)
    handle.wait()
    published = os.path.exists(os.path.join(args.ckpt, name, ckdir.MANIFEST))
    acc.load_state(os.path.join(args.ckpt, name))
    return {"done_at_return": done_at_return, "changed": changed, "published": published,
            "equal_at_call": same(expected)}


def live_ptrs() -> set[int]:
    """Where this rank's live shards (parameters, optimizer state) start."""
    def local(t):
        if hasattr(t, "to_local"):
            return t.to_local()
        return t.local_shards()[0].tensor if hasattr(t, "local_shards") and t.local_shards() else t

    tensors = list(model.parameters()) + [v for s in getattr(opt, "optimizer", opt).state.values() for v in s.values()
                                          if torch.is_tensor(v)]
    return {local(t).data_ptr() for t in tensors}


def reuse() -> dict:
    """Two async saves with training between and after them; the staged memory of each, checked after its wait."""
    expected, ptrs, out = [], [], {}
    for name in ("r1", "r2"):
        expected.append(snapshot())
        handle = acc.save_state(os.path.join(args.ckpt, name), blocking=False)  # r2: waits for r1 first
        out[f"{name}_done_at_return"] = handle.done()
        train(2)  # every shard changes while the save is written
        staging = acc.strategy._checkpoint_staging
        ptrs.append(staging.data_ptrs())
        out[f"{name}_staged_live"] = bool(set(ptrs[-1].values()) & live_ptrs())
        out[f"{name}_nbytes"] = staging.nbytes()
    handle.wait()
    weights = [e[0] for e in expected] + [snapshot()[0]]
    out["every_weight_changed"] = all(not torch.equal(weights[i][k], weights[i + 1][k])
                                      for i in range(2) for k in weights[i])
    out["same_ptrs"] = ptrs[0] == ptrs[1] and len(ptrs[0]) > 0
    for i, name in enumerate(("r1", "r2")):
        acc.load_state(os.path.join(args.ckpt, name))
        out[f"{name}_equal_at_call"] = same(expected[i])
    acc.end_training()
    out["released"] = getattr(acc.strategy, "_checkpoint_staging", None) is None
    return out


def writers() -> list[str]:
    """Threads other than the main one still alive (a write that started on one rank only would be one)."""
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())


train(2)
result: dict = {"world": acc.num_processes}
if args.mode == "state":
    result.update(saved_as_at_the_call("a"))
elif args.mode == "reuse":
    result.update(reuse())
else:
    ARMED.set()
    result["raised_at"] = result["error"] = None
    try:
        handle = acc.save_state(os.path.join(args.ckpt, "bad"), blocking=False)
        result["raised_at"] = "wait"
        handle.wait()
        result["raised_at"] = None
    except CheckpointError as exc:
        result["raised_at"] = result["raised_at"] or "save_state"
        result["error"] = str(exc)
    ARMED.clear()
    acc.wait_for_everyone()
    result["bad_exists"] = os.path.exists(os.path.join(args.ckpt, "bad"))
    result["bad_partial_exists"] = os.path.exists(os.path.join(args.ckpt, "bad.partial"))
    result["writers_after_failure"] = writers()
    train(1)
    result["later"] = saved_as_at_the_call("later")
result["warnings"] = [m for m in messages if "saves synchronously here" in m]
if args.mode != "reuse":  # reuse ended training itself
    acc.end_training()
with open(os.path.join(args.out, f"result_rank{acc.process_index}.json"), "w") as f:
    json.dump(result, f)
