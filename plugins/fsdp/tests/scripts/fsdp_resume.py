"""Worker (1 or 2 processes): load the state fsdp_train.py saved after step S and finish the run.

Writes ``result_resume_<world>.json`` (rank 0): losses of the remaining steps and the
largest weight difference from the uninterrupted run.
"""

from __future__ import annotations

import os

import torch
from fsdp_common import full_state, make_model, max_diff, out_dir, write_json
from fsdp_train import LR, K, S, train

from torchbay import Accelerator


def main():
    out = out_dir()
    acc = Accelerator(strategy="fsdp", seed=123, config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    model = make_model(seed=99)  # different initial weights: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = acc.prepare(opt)  # the optimizer first, its model in a later call: the later call remaps it
    model = acc.prepare(model)
    acc.load_state(os.path.join(out, "ckpt"))
    losses, _ = train(acc, model, opt, K, start=S)
    state = full_state(acc, model)

    # full weights saved by ddp load into a sharded model too
    other = Accelerator(strategy="fsdp", config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    sharded = other.prepare(make_model(seed=99))
    other.load_state(os.path.join(out, "ddp_ckpt"))
    from_ddp = full_state(other, sharded)
    if acc.is_main_process:
        from_ddp_diff = max_diff({k: v.float() for k, v in make_model(seed=5).state_dict().items()}, from_ddp)
        expected = torch.load(os.path.join(out, "uninterrupted.pt"), weights_only=True)
        write_json(os.path.join(out, f"result_resume_{acc.num_processes}.json"),
                   {"losses": losses, "weights_max_diff": max_diff(expected, state), "from_ddp_max_diff": from_ddp_diff,
                    "local_numel": sum(p.to_local().numel() for p in model.parameters()),
                    "numel": sum(p.numel() for p in model.parameters())})
    acc.end_training()


if __name__ == "__main__":
    main()
