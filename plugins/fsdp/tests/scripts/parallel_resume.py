"""Worker (4 processes as dp_shard 4, or 1 process): load the state parallel_train.py saved at
dp_shard 2 x tp 2 after step S, and finish the run on this other mesh.

Writes ``result_resume_<world>.json`` (rank 0): the largest difference between the loaded
weights and those saved, the losses of the remaining steps, and the largest weight difference
from the uninterrupted 2 x 2 run.
"""

from __future__ import annotations

import os

import torch
from parallel_common import GLOBAL_BATCH, LR, S, dataset, full_state, loss_of, make_model, max_diff, out_dir, write_json

from torchbay import Accelerator, ParallelismConfig


def main():
    out = out_dir()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pc = ParallelismConfig(dp_shard_size=world) if world > 1 else None
    acc = Accelerator(strategy="fsdp", seed=5, parallelism_config=pc,
                      config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    model = make_model(seed=99)  # other initial weights: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // acc.strategy.data_parallel_size)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.load_state(os.path.join(out, "ckpt"))
    loaded = full_state(acc, model)
    losses = []
    for _, batch in acc.skip_first_batches(loader, S):  # the global batches after step S, split 4 or 1 ways
        loss = loss_of(model, batch)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach()[None]).mean().item())
    state = full_state(acc, model)
    if acc.is_main_process:
        saved = torch.load(os.path.join(out, "ckpt_weights.pt"), weights_only=True)
        expected = torch.load(os.path.join(out, "uninterrupted.pt"), weights_only=True)
        write_json(os.path.join(out, f"result_resume_{world}.json"),
                   {"loaded_max_diff": max_diff(saved, loaded), "losses": losses,
                    "weights_max_diff": max_diff(expected, state),
                    "mesh_dims": list(acc.torch_device_mesh.mesh_dim_names),
                    "mesh_shape": list(acc.torch_device_mesh.shape)})
    acc.end_training()


if __name__ == "__main__":
    main()
