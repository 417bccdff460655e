"""Worker: sharded (DCP) checkpoints of split experts, resharded across layouts (issue 39).

The torchtitan-style tiny MoE of experts_train.py with 6 experts (at ep 2 x dp_shard 2 each ep rank's 3 experts are
FSDP2-sharded 2 + 1: an uneven split), N AdamW steps, ``save_state``, M more; the model only (no transformers).
``--phase``:

- ``first`` (1 process, ep 1): N steps, save ``ckpt_ep1``, M more; writes ``first.json`` and the weights.
- ``ep`` (4 processes, ep 2 x dp_shard 2): N steps, save ``ckpt_ep`` and ``ckpt_async`` (``blocking=False``, waited
  for after the M more steps); rank 0 merges ``ckpt_ep`` with ``merge_weights``. Then fresh runs (other initial
  weights) load ``ckpt_ep``, ``ckpt_async`` (same layout) and ``ckpt_ep1`` (saved at ep 1 on one process) and
  run the M steps; writes ``ep.json``.
- ``hsdp`` (4 processes, dp_replicate 2 x dp_shard 2 x ep 2: each replica's ep group holds 3 experts each, whole,
  HSDP over the replicas): N steps, save ``ckpt_hsdp``, M more (every loss and the final weights against the
  ``first`` run's); rank 0 merges it; fresh runs load ``ckpt_hsdp`` and ``ckpt_ep1``; writes ``hsdp.json``.
- ``load`` (1 process at ep 1, or 2 at ep 2): load ``ckpt_ep`` (and on 1 process ``ckpt_hsdp``) and run the M
  steps; writes ``load_<world>.json``.

Each load records the largest difference of the loaded weights (whole, experts gathered) from those saved, the M
losses, and the largest difference of the final weights from the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys

import experts_train as moe
import torch

moe.EXPERTS = 6  # read when the model is built and in its forward
N, M, LR, GLOBAL_BATCH = 2, 3, 1e-2, 8


def out_path(*parts: str) -> str:
    return os.path.join(sys.argv[sys.argv.index("--out") + 1], *parts)


def batches():
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, moe.VOCAB, ((N + M) * GLOBAL_BATCH, moe.SEQ + 1), generator=g)


def prepared(ep: int, seed: int, replicate: int = 1):
    from torchbay import Accelerator, ParallelismConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pc = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=world // replicate, ep_size=ep) \
        if world > 1 else None
    acc = Accelerator(strategy="fsdp", parallelism_config=pc)
    torch.manual_seed(seed)
    model = moe.TinyMoE()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(batches(), batch_size=GLOBAL_BATCH // acc.strategy.data_parallel_size)
    return (acc, *acc.prepare(model, opt, loader))


def step(acc, model, opt, ids, grads: dict | None = None) -> float:
    """One AdamW step; ``grads``: filled with the gradients, whole (experts gathered over ep), before it. AdamW
    barely notices a gradient off by a constant factor: the gradients are what show a wrong divide factor."""
    loss = moe.loss_of(model, "tiny", ids)
    acc.backward(loss)
    if grads is not None:
        grads.update(whole_grads(acc, model))
    opt.step()
    opt.zero_grad()
    return acc.gather(loss.detach()[None]).mean().item()


def whole_grads(acc, model) -> dict:
    items = [(n, p.grad) for n, p in model.named_parameters()]
    if acc.strategy._expert_mesh is None:
        return {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for n, g in items}
    return moe.full_state(acc, items)


def whole(acc, model) -> dict:
    """The whole model on rank 0, copied (on one process get_state_dict returns the parameters' own tensors)."""
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def trained(ep: int, saves: dict[str, bool], replicate: int = 1) -> tuple[list[float], dict, dict, dict]:
    """N steps, a save per ``saves`` entry (name: blocking), M more: the N + M losses, the weights at the save, the
    final weights (whole, on rank 0), the first step's gradients (whole)."""
    acc, model, opt, loader = prepared(ep, seed=0, replicate=replicate)
    losses, pending, grads = [], [], {}
    for i, ids in enumerate(loader):
        if i == N:
            for name, blocking in saves.items():
                saved = acc.save_state(out_path(name), blocking=blocking)
                pending += [] if blocking else [saved]
            at_save = whole(acc, model)
        losses.append(step(acc, model, opt, ids, grads if i == 0 else None))
    for saved in pending:
        saved.wait()
    return losses, at_save, whole(acc, model), grads


def expert_layout(model) -> dict:
    """Each expert weight's local shape and FSDP2 mesh dimensions on this rank."""
    return {n: {"local": list(p.to_local().shape), "mesh": list(p.device_mesh.mesh_dim_names)}
            for n, p in model.named_parameters() if p.ndim == 3}


def resumed(ep: int, name: str, at_save: dict | None, final: dict | None, replicate: int = 1) -> dict:
    # other initial weights: everything comes from the checkpoint
    acc, model, opt, loader = prepared(ep, seed=7, replicate=replicate)
    acc.load_state(out_path(name))
    loaded = whole(acc, model)
    losses = [step(acc, model, opt, ids) for ids in acc.skip_first_batches(loader, N)]
    state = acc.get_state_dict(model)
    if not acc.is_main_process:
        return {}
    return {"losses": losses, "loaded_max_diff": max_diff(loaded, at_save), "keys_match": sorted(loaded) ==
            sorted(at_save), "final_max_diff": max_diff(state, final),
            "expert_shapes": {k: list(v.shape) for k, v in loaded.items() if v.ndim == 3}}


def merged(name: str, at_save: dict) -> dict:
    from safetensors.torch import load_file
    from torchbay_fsdp.merge import merge_weights

    written = merge_weights(out_path(name), out_path(f"{name}_merged"))
    state = {}
    for file in written:
        if file.endswith(".safetensors"):
            state.update(load_file(out_path(f"{name}_merged", file)))
    return {"keys_match": sorted(state) == sorted(at_save), "max_diff": max_diff(state, at_save),
            "expert_shapes": sorted({tuple(v.shape) for v in state.values() if v.ndim == 3})}


def hsdp_sum_then_divide(rank: int) -> float:
    """The other branch of ``shard_experts`` under HSDP, whose training run would take 8 processes (dp_shard / ep
    above 1: a reduce-scatter of several ranks, so force-sum): a 3-D weight on the expert mesh of dp_replicate 2 x
    dp_shard 2 x ep 1, the gradient of ``sum(w * (rank + 1))`` on each rank: every local gradient must be the mean,
    2.5 (gloo refuses the PREMUL_SUM FSDP2 would use without force-sum). The largest difference, over the ranks."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchbay_fsdp.experts import expert_mesh, shard_experts

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 2, 2))

        def forward(self, x):
            return (self.w * x).sum()

    module = Experts()
    shard_experts([module], expert_mesh("cpu", 2, 2, 1), MixedPrecisionPolicy(), True)
    module(torch.tensor(float(rank + 1))).backward()
    diff = (module.w.grad.to_local() - 2.5).abs().max()
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)  # every rank's
    return diff.item()


def hsdp(owner) -> dict:
    """dp_replicate 2 x dp_shard 2 x ep 2 on 4 processes: trained and checked against the ``first`` (one-process)
    run, saved, merged, resumed at the same layout and from ``ckpt_ep1``."""
    import torch.distributed as dist

    ep1 = torch.load(out_path("ep1_weights.pt"), weights_only=True)
    losses, at_save, final, grads = trained(2, {"ckpt_hsdp": True}, replicate=2)
    acc, model, _, _ = prepared(2, seed=0, replicate=2)
    layouts = [None] * owner.num_processes
    dist.all_gather_object(layouts, expert_layout(model))
    result = {"layouts": layouts, "sum_then_divide": hsdp_sum_then_divide(owner.process_index)}
    if owner.is_main_process:
        torch.save({"at_save": at_save, "final": final}, out_path("hsdp_weights.pt"))
        result.update(all_losses=losses, at_save_max_diff=max_diff(at_save, ep1["at_save"]),
                      final_max_diff=max_diff(final, ep1["final"]), grad_max_diff=max_diff(grads, ep1["grads"]),
                      merged=merged("ckpt_hsdp", at_save))
    owner.wait_for_everyone()
    result["same_layout"] = resumed(2, "ckpt_hsdp", at_save, final, replicate=2)
    result["from_ep1"] = resumed(2, "ckpt_ep1", ep1["at_save"], ep1["final"], replicate=2)
    return result


def main():
    from torchbay import Accelerator

    owner = Accelerator(strategy="ddp")
    phase, world, result = sys.argv[sys.argv.index("--phase") + 1], owner.num_processes, {}
    if phase == "first":
        losses, at_save, final, grads = trained(1, {"ckpt_ep1": True})
        torch.save({"at_save": at_save, "final": final, "grads": grads}, out_path("ep1_weights.pt"))
        result = {"losses": losses[N:], "all_losses": losses}
    elif phase == "ep":
        losses, at_save, final, _ = trained(2, {"ckpt_ep": True, "ckpt_async": False})
        if owner.is_main_process:
            torch.save({"at_save": at_save, "final": final}, out_path("ep_weights.pt"))
            result = {"losses": losses[N:], "merged": merged("ckpt_ep", at_save)}
        owner.wait_for_everyone()
        result["same_layout"] = resumed(2, "ckpt_ep", at_save, final)
        result["same_layout_async"] = resumed(2, "ckpt_async", at_save, final)
        ep1 = torch.load(out_path("ep1_weights.pt"), weights_only=True)
        result["from_ep1"] = resumed(2, "ckpt_ep1", ep1["at_save"], ep1["final"])
    elif phase == "hsdp":
        result = hsdp(owner)
    else:
        ep = torch.load(out_path("ep_weights.pt"), weights_only=True)
        result = resumed(world, "ckpt_ep", ep["at_save"], ep["final"])
        if world == 1:
            hsdp_weights = torch.load(out_path("hsdp_weights.pt"), weights_only=True)
            result["from_hsdp"] = resumed(1, "ckpt_hsdp", hsdp_weights["at_save"], hsdp_weights["final"])
    if owner.is_main_process:
        name = {"first": "first.json", "ep": "ep.json", "hsdp": "hsdp.json"}.get(phase, f"load_{world}.json")
        with open(out_path(name), "w") as f:
            json.dump(result, f)
    owner.end_training()


if __name__ == "__main__":
    main()
