"""Worker (2 processes, FSDP2 on gloo): Accelerate's save_fsdp_model / load_fsdp_model / save_fsdp_optimizer /
load_fsdp_optimizer as torchbay serves them, for one state_dict_type (``--type FULL_STATE_DICT|SHARDED_STATE_DICT``).

Trains K steps, saves with the four functions, trains K more (the uninterrupted run); a fresh model and optimizer
(other initial weights) load the files and train the same K steps: rank 0 writes their losses, the files, and what
the refusals said. With the real Accelerate importable (``--cross``), Accelerate's own functions read what
torchbay wrote and write what torchbay then reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from fsdp_common import full_state, local_batch, make_model, max_diff, write_json

from torchbay import Accelerator
from torchbay.errors import CheckpointError
from torchbay.utils import (
    FullyShardedDataParallelPlugin,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)

K, LR = 3, 0.05


def train(acc, model, opt, steps, start):
    losses = []
    for i in range(start, start + steps):
        x, y = local_batch(i, acc.process_index, acc.num_processes)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def fresh(acc, seed=99):
    model = acc.prepare(make_model(seed=seed))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, opt


def refused(fn) -> str:
    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    return ""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--type", required=True)
    parser.add_argument("--cross", action="store_true")
    args = parser.parse_args()
    plugin = FullyShardedDataParallelPlugin(state_dict_type=args.type, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])
    acc = Accelerator(fsdp_plugin=plugin)
    shown = acc.state.fsdp_plugin
    ckpt = os.path.join(args.out, "ckpt")

    model, opt = fresh(acc, seed=0)
    first = train(acc, model, opt, K, 0)
    save_fsdp_model(shown, acc, model, ckpt)
    save_fsdp_optimizer(shown, acc, opt, model, ckpt)
    # again, same weights: torchbay replaces its own file / its own DCP folder
    again = refused(lambda: save_fsdp_model(shown, acc, model, ckpt))
    saved_weights = full_state(acc, model)
    uninterrupted = train(acc, model, opt, K, K)

    model2, opt2 = fresh(acc)
    load_fsdp_model(shown, acc, model2, ckpt)
    load_fsdp_optimizer(shown, acc, opt2, model2, ckpt)
    loaded = full_state(acc, model2)  # collective; rank 0 holds the full weights
    loaded_diff = max_diff(saved_weights, loaded) if acc.is_main_process else None
    resumed = train(acc, model2, opt2, K, K)

    # a file of that name torchbay did not write is never overwritten: every rank refuses, nothing changes
    foreign_dir = os.path.join(args.out, "foreign")
    foreign_name = "pytorch_model_fsdp.bin" if args.type == "FULL_STATE_DICT" else "pytorch_model_fsdp_0"
    if acc.is_main_process:
        os.makedirs(foreign_dir, exist_ok=True)
        if args.type == "FULL_STATE_DICT":
            torch.save({"mine": torch.zeros(1)}, os.path.join(foreign_dir, foreign_name))
        else:
            os.makedirs(os.path.join(foreign_dir, foreign_name), exist_ok=True)
            with open(os.path.join(foreign_dir, foreign_name, "notes.txt"), "w") as f:
                f.write("mine")
    acc.wait_for_everyone()
    foreign = refused(lambda: save_fsdp_model(shown, acc, model, foreign_dir))
    missing = refused(lambda: load_fsdp_optimizer(shown, acc, opt2, model2, os.path.join(args.out, "nowhere")))

    result = {"first": first, "uninterrupted": uninterrupted, "resumed": resumed, "again": again,
              "foreign": foreign, "missing": missing, "loaded_diff": loaded_diff,
              "same_object": shown is plugin, "fsdp_version": shown.fsdp_version,
              "state_dict_type": str(shown.state_dict_type), "files": sorted(os.listdir(ckpt)),
              "argv": sys.argv[1:]}
    mark = os.path.join(ckpt, "pytorch_model_fsdp_0", ".torchbay_fsdp.json")
    if os.path.exists(mark):
        with open(mark) as f:
            result["mark"] = sorted(json.load(f)["files"])

    if args.cross:  # the real Accelerate's functions on the same files (with torchbay's accelerator and model)
        import logging

        from accelerate.utils import fsdp_utils as real

        real.logger = logging.getLogger("accelerate-fsdp-utils")  # its own logger insists on Accelerate's state
        from torch.distributed.fsdp import StateDictType

        class Plugin:  # the fields Accelerate's functions read (its own plugin object wants a GPU)
            fsdp_version = 2
            state_dict_type = StateDictType[args.type]
            state_dict_config = shown.state_dict_config
            optim_state_dict_config = shown.optim_state_dict_config
            sync_module_states = None

        model3, opt3 = fresh(acc)
        real.load_fsdp_model(Plugin, acc, model3, ckpt)
        real.load_fsdp_optimizer(Plugin, acc, opt3, model3, ckpt)
        result["accelerate_reads_torchbay"] = train(acc, model3, opt3, K, K)
        theirs = os.path.join(args.out, "written_by_accelerate")
        model4, opt4 = fresh(acc, seed=0)
        train(acc, model4, opt4, K, 0)
        real.save_fsdp_model(Plugin, acc, model4, theirs)
        real.save_fsdp_optimizer(Plugin, acc, opt4, model4, theirs)
        model5, opt5 = fresh(acc)
        load_fsdp_model(shown, acc, model5, theirs)
        load_fsdp_optimizer(shown, acc, opt5, model5, theirs)
        result["torchbay_reads_accelerate"] = train(acc, model5, opt5, K, K)
        result["overwrite_accelerate_file"] = refused(lambda: save_fsdp_model(shown, acc, model5, theirs))

    if acc.is_main_process:
        if args.type == "FULL_STATE_DICT":  # a plain full state dict, as Accelerate writes it
            full = torch.load(os.path.join(ckpt, "pytorch_model_fsdp.bin"), weights_only=True)
            result["full_keys_match"] = sorted(full) == sorted(saved_weights)
            result["full_diff"] = max_diff(saved_weights, {k: v.float() for k, v in full.items()})
            if args.cross:
                result["foreign_unchanged"] = sorted(torch.load(os.path.join(foreign_dir, foreign_name),
                                                                weights_only=True)) == ["mine"]
        write_json(os.path.join(args.out, "result.json"), result)
    acc.end_training()


if __name__ == "__main__":
    main()
