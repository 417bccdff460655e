"""Worker: resume the pp 2 x dp_shard 2 checkpoint (saved after step S by pipeline_train.py's run pp2_dp2).

``--sizes pp2_dp2`` (4 processes): the same shape; ``--sizes one`` (1 process, fsdp over one rank): resharded.
Loads --out/ckpt, trains steps S..K on the same batches, writes ``result_resume_<sizes>.json``: the largest
weight difference from the uninterrupted run, and the losses. ``--save-to DIR`` also saves the state after
loading (a one-process checkpoint, loaded back at pp 2 by the next run: ``--ckpt DIR``).
"""

from __future__ import annotations

import os
import sys

import torch
from pipeline_common import GLOBAL_BATCH, LR, K, S, dataset, loss_fn, make_model, max_diff, write_json

from torchbay import Accelerator, ParallelismConfig

SIZES = {"pp2_dp2": dict(pp_size=2, dp_shard_size=2, pp_schedule="1F1B", pp_microbatches=2), "one": None}


def main():
    out = sys.argv[sys.argv.index("--out") + 1]
    name = sys.argv[sys.argv.index("--sizes") + 1]
    ckpt = sys.argv[sys.argv.index("--ckpt") + 1] if "--ckpt" in sys.argv else os.path.join(out, "ckpt")
    config = ParallelismConfig(**SIZES[name]) if SIZES[name] else None
    acc = Accelerator(strategy="fsdp", seed=0, parallelism_config=config,
                      config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    dp = acc.strategy.data_parallel_size
    loader = torch.utils.data.DataLoader(dataset(K), batch_size=GLOBAL_BATCH // dp)
    model = make_model(seed=1)  # other weights: the checkpoint must replace them
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.load_state(ckpt)
    if "--save-to" in sys.argv:
        acc.save_state(sys.argv[sys.argv.index("--save-to") + 1])
    losses = []
    for step, (_, tokens) in enumerate(loader):
        if step < S:
            continue
        if acc.strategy.pipeline_enabled:
            loss = acc.pipeline_loss(model, tokens[:, :-1], tokens[:, 1:], loss_fn)
        else:
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach()[None]).mean().item())
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        uninterrupted = torch.load(os.path.join(out, "uninterrupted.pt"), weights_only=True)
        write_json(os.path.join(out, f"result_resume_{name}{'_back' if '--ckpt' in sys.argv else ''}.json"),
                   {"losses": losses, "weights_max_diff": max_diff(uninterrupted, state),
                    "uninterrupted_same_keys": set(uninterrupted) == set(state)})
    acc.end_training()


if __name__ == "__main__":
    main()
