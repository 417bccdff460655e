"""Worker (2 processes, an accelerator each): context parallel (cp 2) against a one-device reference.

Each rank holds half of every sequence inside ``accelerator.maybe_context_parallel``; FSDP
shards over dp_shard_cp = cp. Writes ``result_cp.json`` (rank 0): losses of both runs and the
largest weight difference. Needs 2 accelerator devices (skipped elsewhere: torch has no CPU
sharding rule for SDPA).
"""

from __future__ import annotations

import os

import torch
from parallel_common import LR, VOCAB, full_state, make_model, max_diff, out_dir, write_json

from torchbay import Accelerator, ParallelismConfig

STEPS, BATCH, SEQ = 3, 4, 16  # SEQ: a multiple of 2 x cp (load-balanced causal attention)


def batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def main():
    out = out_dir()
    acc = Accelerator(strategy="fsdp", seed=0, parallelism_config=ParallelismConfig(cp_size=2),
                      config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    reference = make_model().to(acc.device)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    losses, ref_losses = [], []
    for tokens in batches():
        tokens = tokens.to(acc.device)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        ref_loss = torch.nn.functional.cross_entropy(reference(inputs).reshape(-1, VOCAB), labels.reshape(-1))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
        with acc.maybe_context_parallel(buffers=[inputs, labels], buffer_seq_dims=[1, 1],
                                        no_restore_buffers={inputs, labels}):
            loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, VOCAB), labels.reshape(-1))
            acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach()[None]).mean().item())  # each rank: half of every sequence
    state = full_state(acc, model)
    if acc.is_main_process:
        ref_state = {k: v.detach().float().cpu() for k, v in reference.state_dict().items()}
        write_json(os.path.join(out, "result_cp.json"),
                   {"losses": losses, "reference_losses": ref_losses, "weights_max_diff": max_diff(ref_state, state),
                    "mesh_dims": list(acc.torch_device_mesh.mesh_dim_names)})
    acc.end_training()


if __name__ == "__main__":
    main()
