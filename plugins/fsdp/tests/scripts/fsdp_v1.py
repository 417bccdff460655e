"""Worker (1+ processes on an accelerator): FSDP1 (fsdp.version: 1) against DDP/single, and a
sharded save_state / load_state round trip. Writes ``result_v1.json`` (rank 0) into ``--out``."""

from __future__ import annotations

import os

import torch
from fsdp_common import full_state, make_model, max_diff, out_dir, write_json
from fsdp_train import LR, train

from torchbay import Accelerator


def main():
    out = out_dir()
    device = os.environ["FSDP_TEST_DEVICE"]
    ref = owner = Accelerator(device=device, strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single",
                              seed=0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = ref.prepare(model, opt)
    ref_losses, _ = _train_on(ref, model, opt)
    ref_state = full_state(ref, model)

    acc = Accelerator(device=device, strategy="fsdp", seed=0,
                      config={"fsdp": {"version": 1, "transformer_layer_cls_to_wrap": ["Block"]}})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    losses, _ = _train_on(acc, model, opt)
    state = full_state(acc, model)
    acc.save_state(os.path.join(out, "ckpt_v1"))
    acc.load_state(os.path.join(out, "ckpt_v1"))
    if acc.is_main_process:
        write_json(os.path.join(out, "result_v1.json"), {"ref_losses": ref_losses, "losses": losses,
                                                         "weights_max_diff": max_diff(ref_state, state)})
    owner.end_training()


def _train_on(acc, model, opt):
    return train(acc, model, opt, 3)


if __name__ == "__main__":
    main()
