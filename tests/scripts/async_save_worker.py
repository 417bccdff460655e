"""Asynchronous save_state in a real process (or two, under torchrun with gloo).

Modes:
  kill      one published checkpoint, then an async save whose writer is held; prints HELD and
            sleeps (the test SIGKILLs it while the background write runs)
  exit      an async save whose writer is slowed, then the script ends without wait()
  ranks     2 processes: async save, train on, wait, load, compare to the state at the call;
            then a save whose writer fails on rank 1 only: both ranks get the error
  fsdp      2 processes, FSDP2: async save (DCP async_save), train on, wait, load, compare to the call
"""

import argparse
import json
import os
import sys
import threading
import time

import torch

from torchbay import Accelerator, CheckpointError
from torchbay.storage import files as ckfiles
from torchbay.storage import publish as ckdir

parser = argparse.ArgumentParser()
parser.add_argument("--mode", required=True)
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()


def build(acc, width=256, layers=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return acc.prepare(model, opt)


def train(acc, model, opt, steps=2):
    for _ in range(steps):
        acc.backward(model(torch.randn(8, 256)).pow(2).mean())
        opt.step()
        opt.zero_grad()


def snapshot(model, opt):
    module = getattr(model, "module", model)
    return ({k: v.clone() for k, v in module.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
             for i, s in opt.state_dict()["state"].items()})


def same(model, opt, expected) -> bool:
    weights, states = snapshot(model, opt)
    return (all(torch.equal(weights[k], expected[0][k]) for k in weights)
            and all(torch.equal(states[i][k], expected[1][i][k]) for i in states for k in states[i]))


original_write = ckfiles.RecordingWriter.write


def slow_writes(seconds: float, only_rank: int | None = None) -> None:
    """Each chunk the background writer writes waits ``seconds`` (torchbay's own writer, in this process)."""
    def write(self, data):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        return original_write(self, data)

    ckfiles.RecordingWriter.write = write


if args.mode == "kill":
    acc = Accelerator()
    model, opt = build(acc)
    train(acc, model, opt)
    acc.save_state(os.path.join(args.ckpt, "first"))
    train(acc, model, opt)
    acc.save_state(os.path.join(args.ckpt, "second"), blocking=False).wait()
    held = threading.Event()

    def write(self, data):
        if threading.current_thread() is not threading.main_thread():
            held.set()
            time.sleep(3600)  # the background write never finishes: the process is killed here
        return original_write(self, data)

    ckfiles.RecordingWriter.write = write
    train(acc, model, opt)
    handle = acc.save_state(os.path.join(args.ckpt, "second"), blocking=False)  # replaces a published one
    held.wait(60)
    print("HELD", flush=True)
    time.sleep(3600)

elif args.mode == "exit":
    acc = Accelerator()
    model, opt = build(acc)
    train(acc, model, opt)
    expected = snapshot(model, opt)
    torch.save(expected, os.path.join(args.out, "expected.pt"))
    slow_writes(0.01)
    handle = acc.save_state(os.path.join(args.ckpt, "at_exit"), blocking=False)
    train(acc, model, opt)  # the script ends here, the writer still running
    print("LEFT", handle.done(), flush=True)

elif args.mode == "ranks":
    acc = Accelerator()
    model, opt = build(acc)
    rank = acc.process_index
    result = {"world": acc.num_processes}
    train(acc, model, opt)
    expected = snapshot(model, opt)
    slow_writes(0.002)
    handle = acc.save_state(os.path.join(args.ckpt, "good"), blocking=False)
    train(acc, model, opt, steps=3)  # every tensor changes while the writer runs
    result["changed"] = not same(model, opt, expected)
    result["done_before_wait"] = handle.done()
    handle.wait()
    result["done_after_wait"] = handle.done()
    acc.load_state(os.path.join(args.ckpt, "good"))
    result["equal_at_call"] = same(model, opt, expected)

    original = ckfiles.torch_save_recorded

    def failing(obj, path):
        if rank == 1 and os.path.basename(path) == "rng_state_1.pt":
            raise OSError(28, "No space left on device (injected on rank 1)")
        return original(obj, path)

    ckfiles.torch_save_recorded = failing
    handle = acc.save_state(os.path.join(args.ckpt, "bad"), blocking=False)
    train(acc, model, opt)
    try:
        handle.wait()
        result["error"] = None
    except CheckpointError as exc:
        result["error"] = str(exc)
    ckfiles.torch_save_recorded = original
    result["bad_exists"] = os.path.exists(os.path.join(args.ckpt, "bad"))
    acc.wait_for_everyone()
    result["bad_partial_exists"] = os.path.exists(os.path.join(args.ckpt, "bad.partial"))
    # a save left in flight is finished by end_training on every rank
    handle = acc.save_state(os.path.join(args.ckpt, "last"), blocking=False)
    acc.end_training()
    result["last_done"] = handle.done()
    result["last_published"] = os.path.exists(os.path.join(args.ckpt, "last", ckdir.MANIFEST))
    with open(os.path.join(args.out, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)
elif args.mode == "fsdp":
    import logging

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("torchbay").addHandler(Keep())
    acc = Accelerator(strategy="fsdp")
    model, opt = build(acc, width=32, layers=2)

    def fsdp_steps(n):
        for _ in range(n):
            acc.backward(model(torch.randn(8, 32)).pow(2).mean())
            opt.step()
            opt.zero_grad()

    def full(value):
        return value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()

    def fsdp_snapshot():  # collectives: every rank, main thread
        return ({k: full(v) for k, v in model.state_dict().items()},
                {i: {k: full(v) for k, v in st.items() if torch.is_tensor(v)}
                 for i, st in opt.state_dict()["state"].items()})

    def fsdp_same(expected):
        now = fsdp_snapshot()
        return (all(torch.equal(now[0][k], expected[0][k]) for k in expected[0])
                and all(torch.equal(now[1][i][k], expected[1][i][k]) for i in expected[1] for k in expected[1][i]))

    fsdp_steps(2)
    expected = fsdp_snapshot()
    handle = acc.save_state(os.path.join(args.ckpt, "a"), blocking=False)
    done_at_return = handle.done()
    fsdp_steps(3)  # every shard changes while DCP writes
    changed = not fsdp_same(expected)
    handle.wait()
    acc.load_state(os.path.join(args.ckpt, "a"))
    result = {"done_at_return": done_at_return, "changed": changed, "equal_at_call": fsdp_same(expected),
              "published": os.path.exists(os.path.join(args.ckpt, "a", ckdir.MANIFEST)),
              "warnings": [m for m in messages if "saves synchronously here" in m]}
    acc.end_training()
    with open(os.path.join(args.out, f"result_rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)
else:
    sys.exit(f"unknown mode {args.mode}")
