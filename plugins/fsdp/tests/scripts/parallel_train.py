"""Worker (4 processes): N-D parallel runs of a small transformer against a single-process reference.

Runs in one process group, each with a fresh Accelerator(strategy="fsdp", parallelism_config=...):
  fsdp4      dp_shard 4
  hsdp       dp_replicate 2 x dp_shard 2
  fsdp2_tp2  dp_shard 2 x tp 2 (tp_plan: PLAN); save_state after step S into --out/ckpt
  fsdp2_tp2_every_style  dp_shard 2 x tp 2, EveryStyleNet with every_style_plan(): the styles
             PLAN does not use (colwise_rep, rowwise_rep, sequence_parallel, local_colwise,
             local_rowwise, replicate), each parameter's placements recorded
Every run reads the same global batches through a prepared DataLoader (batch size per data
parallel rank = GLOBAL_BATCH / dp). Writes ``result_train.json`` (rank 0): per run the losses,
the reference's, the largest weight difference after K steps, the sample ids each rank read,
each rank's parameter bytes and the mesh.
"""

from __future__ import annotations

import os

import torch
from parallel_common import (
    GLOBAL_BATCH,
    LR,
    PLAN,
    S,
    dataset,
    every_style_plan,
    full_state,
    local_param_bytes,
    loss_of,
    make_model,
    max_diff,
    out_dir,
    reference,
    write_json,
)

from torchbay import Accelerator, ParallelismConfig

RUNS = {
    "fsdp4": dict(dp_shard_size=4),
    "hsdp": dict(dp_replicate_size=2, dp_shard_size=2),
    "fsdp2_tp2": dict(dp_shard_size=2, tp_size=2, tp_plan=PLAN),
    "fsdp2_tp2_every_style": dict(dp_shard_size=2, tp_size=2),  # tp_plan: every_style_plan(), built in run()
}


def run(name: str, sizes: dict, out: str) -> dict:
    every_style = name.endswith("every_style")
    if every_style:  # torch ParallelStyle objects: built once torch.distributed is usable
        sizes = {**sizes, "tp_plan": every_style_plan()}
    ref_losses, ref_state = reference(every_style=every_style)
    acc = Accelerator(strategy="fsdp", seed=0, parallelism_config=ParallelismConfig(**sizes),
                      config={"fsdp": {"transformer_layer_cls_to_wrap": [] if every_style else ["Block"]}})
    mesh = acc.torch_device_mesh
    dp = acc.strategy.data_parallel_size
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp)
    model = make_model(every_style=every_style)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, loader)
    param_bytes = acc.gather(torch.tensor([local_param_bytes(model)])).tolist()
    outputs = record_outputs(model) if every_style else {}
    losses, seen, metrics = [], [], []
    for step, (ids, tokens) in enumerate(loader):
        loss = loss_of(model, tokens)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach()[None]).mean().item())  # tp ranks hold equal losses
        seen.append(acc.gather(ids[None]).tolist())  # [rank][sample ids]
        metrics.append(acc.gather_for_metrics(ids).tolist())  # every sample of the step once
        metrics.append(acc.gather_for_metrics([int(i) for i in ids], use_gather_object=True))
        if name == "fsdp2_tp2" and step + 1 == S:
            acc.save_state(os.path.join(out, "ckpt"))
            snapshot = full_state(acc, model)
            if acc.is_main_process:
                torch.save(snapshot, os.path.join(out, "ckpt_weights.pt"))
    state = full_state(acc, model)
    result = {"losses": losses, "reference_losses": ref_losses,
              "weights_max_diff": max_diff(ref_state, state) if acc.is_main_process else None,
              "seen": seen, "gathered_for_metrics": metrics, "param_bytes": param_bytes, "data_parallel_size": dp,
              "data_parallel_rank": acc.gather(torch.tensor([acc.data_parallel_rank])).tolist(),
              "mesh_dims": list(mesh.mesh_dim_names), "mesh_shape": list(mesh.shape),
              "dp_mesh_size": mesh["dp"].size(), "dp_shard_cp_size": mesh["dp_shard_cp"].size(),
              "dp_cp_size": mesh["dp_cp"].size(),
              "parallelism_config_sizes": acc.parallelism_config.sizes,
              "config_mesh_is_accelerator_mesh": acc.parallelism_config.device_mesh is mesh}
    if every_style:
        result["outputs"] = outputs
        result["placements"] = {n: [str(p) for p in param.placements] for n, param in model.named_parameters()}
        result["tp_plan_applied"] = sorted(acc.strategy.tp_plans[0])
    if name == "fsdp2_tp2":
        from torchbay import prepare_data_loader

        # Accelerate's free function with the mesh: tp ranks read the same batch there too
        free = prepare_data_loader(torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // dp),
                                   torch_device_mesh=mesh)
        result["free_function_first_ids"] = acc.gather(next(iter(free))[0][None]).tolist()
        result["tp_rank"] = acc.gather(torch.tensor([acc.tensor_parallel_rank])).tolist()
        result["tp_plan_applied"] = sorted(acc.strategy.tp_plans[0])
        if acc.is_main_process:
            torch.save(state, os.path.join(out, "uninterrupted.pt"))
        result["uninterrupted_losses"] = losses[S:]
    return result


def record_outputs(model) -> dict[str, str]:
    """What each top-level module hands on in the first forward: ``DTensor(<placements>)`` or
    ``Tensor(<shape>)`` (a plain tensor), filled in place."""
    from torch.distributed.tensor import DTensor

    seen: dict[str, str] = {}

    def describe(name):
        def hook(module, args, output):
            if name not in seen:
                seen[name] = (f"DTensor({', '.join(str(p) for p in output.placements)})"
                              if isinstance(output, DTensor) else f"Tensor({list(output.shape)})")
        return hook

    for name, module in model.named_children():
        module.register_forward_hook(describe(name))
    return seen


def main():
    out = out_dir()
    owner = Accelerator(strategy="ddp")  # owns the process group for the whole script
    result = {name: run(name, sizes, out) for name, sizes in RUNS.items()}
    result["full_param_bytes"] = {k: v.numel() * v.element_size() for k, v in make_model().state_dict().items()}
    if owner.is_main_process:
        write_json(os.path.join(out, "result_train.json"), result)
    owner.end_training()


if __name__ == "__main__":
    main()
