"""Worker: pipeline-parallel runs of a small transformer against a single-process reference.

``--runs NAME[,NAME...]`` (each a fresh Accelerator(strategy="fsdp") in one process group; 2 processes for
pp 2 alone, 4 for pp 2 x dp_shard 2). The loop is the usual one with the one pipeline line:
``loss = accelerator.pipeline_loss(model, inputs, target, loss_fn)``. Writes ``result_<run>.json`` (rank 0):
losses, the reference's, gradient norms, the largest weight difference, each rank's parameter names and bytes.
"""

from __future__ import annotations

import os
import sys

import torch
from parallel_common import PLAN, local_param_bytes
from pipeline_common import GLOBAL_BATCH, LR, K, S, dataset, loss_fn, make_model, max_diff, reference, write_json

from torchbay import Accelerator, ParallelismConfig

RUNS = {
    "gpipe": dict(pp_size=2, pp_schedule="GPipe", pp_microbatches=4),
    "1f1b": dict(pp_size=2, pp_schedule="1F1B", pp_microbatches=4),
    "interleaved": dict(pp_size=2, pp_schedule="Interleaved1F1B", pp_microbatches=4),
    "zero_bubble": dict(pp_size=2, pp_schedule="InterleavedZeroBubble", pp_microbatches=4),
    "zbv": dict(pp_size=2, pp_schedule="ZBVZeroBubble", pp_microbatches=4),
    "meta_init": dict(pp_size=2, pp_schedule="GPipe", pp_microbatches=2),
    "accumulate": dict(pp_size=2, pp_schedule="1F1B", pp_microbatches=2),  # 2 accumulation steps of half a batch
    "split_points": dict(pp_size=2, pp_schedule="1F1B", pp_microbatches=2, pp_split_points=["blocks.1"]),
    "pp2_dp2": dict(pp_size=2, dp_shard_size=2, pp_schedule="1F1B", pp_microbatches=2),
    "pp2_tp2": dict(pp_size=2, tp_size=2, pp_schedule="1F1B", pp_microbatches=2, tp_plan=PLAN),
    "pp2_ddp2": dict(pp_size=2, dp_replicate_size=2, pp_schedule="GPipe", pp_microbatches=2),
    "pp2_dp2_accumulate": dict(pp_size=2, dp_shard_size=2, pp_schedule="1F1B", pp_microbatches=2),
    "zbv_dp2": dict(pp_size=2, dp_shard_size=2, pp_schedule="ZBVZeroBubble", pp_microbatches=4),
}


def run(name: str, out: str) -> dict:
    ref_losses, ref_norms, ref_state = reference()
    accumulation = 2 if name in ("accumulate", "pp2_dp2_accumulate") else 1
    acc = Accelerator(strategy="fsdp", seed=0, parallelism_config=ParallelismConfig(**RUNS[name]),
                      gradient_accumulation_steps=accumulation,
                      config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    dp = acc.strategy.data_parallel_size
    loader = torch.utils.data.DataLoader(dataset(K), batch_size=GLOBAL_BATCH // dp // accumulation)
    if name == "meta_init":  # built without memory; each rank materialises its stage only
        with torch.device("meta"):
            model = make_model()
    else:
        model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, loader)
    if name == "meta_init":
        return meta_init_result(acc, model, opt, loader)
    names = acc.strategy.all_gather_object(sorted(n for n, _ in model.named_parameters()))
    param_bytes = acc.gather(torch.tensor([local_param_bytes(model)])).tolist()
    losses, norms, metrics, window, grads_mid_window = [], [], [], [], []
    for step, (ids, tokens) in enumerate(loader):
        with acc.accumulate(model):
            loss = acc.pipeline_loss(model, tokens[:, :-1], tokens[:, 1:], loss_fn)
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
            else:  # reduced gradients appear only at the window's last step (held unsharded until then)
                grads_mid_window.append(any(p.grad is not None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        window.append(acc.gather(loss.detach()[None]))  # every rank's view of the loss
        metrics.append(acc.gather_for_metrics(ids).tolist())  # each sample of the step once
        if acc.sync_gradients:
            losses.append(torch.stack(window).mean(0).tolist())
            window = []
        if name in ("pp2_dp2", "pp2_ddp2") and len(losses) == S and not window:
            blocking = name == "pp2_dp2"  # pp2_ddp2: save_state(blocking=False)
            saved = acc.save_state(os.path.join(out, "ckpt" if blocking else "ckpt_async"), blocking=blocking)
            if not blocking:
                saved.wait()
            snapshot = acc.get_state_dict(model)
            if acc.is_main_process:
                torch.save(snapshot, os.path.join(out, f"{name}_weights_at_S.pt"))
    eval_loss = None
    if "--no-eval" not in sys.argv:
        model.eval()
        with torch.no_grad():
            eval_loss = acc.pipeline_loss(model, tokens[:, :-1], tokens[:, 1:], loss_fn).item()
    state = acc.get_state_dict(model)
    result = {"losses": losses, "reference_losses": ref_losses, "norms": norms, "reference_norms": ref_norms,
              "eval_loss": eval_loss, "names": names, "gathered_for_metrics": metrics, "param_bytes": param_bytes,
              "grads_mid_window": sum(acc.strategy.all_gather_object(grads_mid_window), []),
              "mesh_dims": list(acc.torch_device_mesh.mesh_dim_names),
              "mesh_shape": list(acc.torch_device_mesh.shape)}
    if acc.is_main_process:
        result["weights_max_diff"] = max_diff(ref_state, state)
        result["state_keys_in_order"] = list(state) == list(ref_state)
        if name == "pp2_dp2":
            torch.save(state, os.path.join(out, "uninterrupted.pt"))
    result["reference_eval_loss"] = _reference_eval(ref_state, tokens)
    return result


def meta_init_result(acc, model, opt, loader) -> dict:
    on_meta = acc.strategy.all_gather_object([n for n, t in model.state_dict().items() if t.is_meta])
    losses = []
    for _, tokens in loader:
        loss = acc.pipeline_loss(model, tokens[:, :-1], tokens[:, 1:], loss_fn)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"on_meta": on_meta, "losses": losses, "param_bytes": acc.gather(
        torch.tensor([local_param_bytes(model)])).tolist()}


def _reference_eval(state, tokens) -> float:
    model = make_model()
    model.load_state_dict(state)
    with torch.no_grad():
        return loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).item()


def main():
    out = sys.argv[sys.argv.index("--out") + 1]
    runs = sys.argv[sys.argv.index("--runs") + 1].split(",")
    owner = Accelerator(strategy="ddp")  # owns the process group for the whole script
    for name in runs:
        result = run(name, out)
        if owner.is_main_process:
            write_json(os.path.join(out, f"result_{name}.json"), result)
    owner.end_training()


if __name__ == "__main__":
    main()
