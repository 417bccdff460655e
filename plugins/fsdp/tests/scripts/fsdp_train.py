"""Worker (2 processes): FSDP2 against DDP on the same data and seed, plus a mid-run save_state.

Writes ``result_train.json`` (rank 0) into ``--out``; the test asserts on it.
Runs, each with a fresh Accelerator in this one process group:
  ddp_plain / fsdp_plain: K steps, no accumulation; fsdp prepares model and optimizer in
      separate calls with the optimizer built before sharding; save_state after step S.
  ddp_accum / fsdp_accum: accumulation 2 and gradient clipping; fsdp with activation
      checkpointing, one prepare call.
  fsdp_meta: cpu_ram_efficient_loading with rank 1 building the model on meta.
"""

from __future__ import annotations

import os

import torch
from fsdp_common import full_state, local_batch, make_model, max_diff, out_dir, write_json

from torchbay import Accelerator

K, S, LR, CLIP = 6, 3, 1e-2, 0.05


def train(acc, model, opt, steps, start=0, accum=1, clip=None, save_at=None, save_dir=None, unsynced=None):
    """Run ``steps``; ``unsynced`` collects, per accumulation micro-batch, whether no sharded
    gradient exists yet (fsdp must not reduce-scatter before the window's last micro-batch)."""
    losses, norms = [], []
    for step in range(start, steps):
        step_loss = []
        for micro in range(accum):
            x, y = local_batch(step * accum + micro, acc.process_index, acc.num_processes)
            x, y = x.to(acc.device), y.to(acc.device)
            with acc.accumulate(model):
                out = model(x)
                loss = torch.nn.functional.mse_loss(out, y)
                acc.backward(loss)
                if unsynced is not None and not acc.sync_gradients:
                    unsynced.append(all(p.grad is None for p in model.parameters()))
                if acc.sync_gradients and clip is not None:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()
            step_loss.append(acc.gather_for_metrics(loss.detach()[None]).mean().item())
        losses.append(sum(step_loss) / accum)
        if save_at is not None and step + 1 == save_at:
            acc.save_state(save_dir)
            snapshot = full_state(acc, model)  # collective
            if acc.is_main_process:
                torch.save(snapshot, save_dir + "_weights.pt")
    return losses, norms


def main():
    out = out_dir()
    result: dict = {}

    # --- plain: DDP reference, then FSDP2 with separate prepare calls --------------------
    ddp = owner = Accelerator(strategy="ddp", seed=0)  # owns the process group
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = ddp.prepare(model, opt)
    ddp_losses, _ = train(ddp, model, opt, K)
    ddp_state = full_state(ddp, model)
    ddp.save_model(model, os.path.join(out, "ddp_model"))

    # a checkpoint of full weights (ddp, model only) for fsdp_resume.py to load into fsdp
    other = Accelerator(strategy="ddp")
    other.prepare(make_model(seed=5))
    other.save_state(os.path.join(out, "ddp_ckpt"))

    acc = Accelerator(strategy="fsdp", seed=0, config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # built before sharding: prepare must remap it
    model = acc.prepare(model)
    opt = acc.prepare(opt)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    result["wrapped_blocks"] = sum(isinstance(b, FSDPModule) for b in model.blocks)
    result["optimizer_remapped"] = all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
    result["shards"] = {name: [p.to_local().numel(), p.numel()] for name, p in model.named_parameters()
                        if isinstance(p, DTensor)}
    result["num_params"] = sum(1 for _ in model.parameters())
    fsdp_losses, _ = train(acc, model, opt, K, save_at=S, save_dir=os.path.join(out, "ckpt"))
    result["fsdp_plain"] = {"ddp_losses": ddp_losses, "fsdp_losses": fsdp_losses,
                            "weights_max_diff": max_diff(ddp_state, full_state(acc, model))}
    acc.save_model(model, os.path.join(out, "fsdp_model"))
    result["unwrap_is_model"] = acc.unwrap_model(model) is model
    if acc.is_main_process:
        torch.save(full_state(acc, model), os.path.join(out, "uninterrupted.pt"))
    else:
        full_state(acc, model)  # collective: every rank takes part
    result["uninterrupted_losses"] = fsdp_losses[S:]

    # --- accumulation + clipping (+ activation checkpointing) --------------------------
    ddp = Accelerator(strategy="ddp", seed=0, gradient_accumulation_steps=2)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = ddp.prepare(model, opt)
    ddp_losses, ddp_norms = train(ddp, model, opt, 4, accum=2, clip=CLIP)
    ddp_state = full_state(ddp, model)

    acc = Accelerator(strategy="fsdp", seed=0, gradient_accumulation_steps=2,
                      config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"], "activation_checkpointing": True}})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    unsynced: list = []
    fsdp_losses, fsdp_norms = train(acc, model, opt, 4, accum=2, clip=CLIP, unsynced=unsynced)
    result["fsdp_accum"] = {"no_sharded_grad_before_sync": unsynced, "ddp_losses": ddp_losses,
                            "fsdp_losses": fsdp_losses, "ddp_norms": ddp_norms, "fsdp_norms": fsdp_norms,
                            "weights_max_diff": max_diff(ddp_state, full_state(acc, model))}

    # --- cpu_ram_efficient_loading: rank 1 never holds real weights before sharding -----
    acc = Accelerator(strategy="fsdp", config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"],
                                                        "cpu_ram_efficient_loading": True}})
    model = make_model(seed=7, meta=acc.process_index != 0)
    model = acc.prepare(model)
    x, _ = local_batch(0, 0, 1)
    reference = make_model(seed=7)
    expected = reference(x)
    got = model(x)
    result["meta_loading"] = {"weights_max_diff": max_diff({k: v.float() for k, v in reference.state_dict().items()},
                                                           full_state(acc, model)),
                              "output_max_diff": (got - expected).abs().max().item(),
                              "buffer": model.out_scale.tolist()}

    # --- precision plugins compose: bf16 -> MixedPrecisionPolicy, fp16 -> a sharded scaler ---
    result["bf16"] = {}
    for name in ("ddp", "fsdp"):
        acc = Accelerator(strategy=name, seed=0, mixed_precision="bf16",
                          config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}} if name == "fsdp" else None)
        model = make_model()
        seen = []
        model.blocks[0].up.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = acc.prepare(model, opt)
        losses, _ = train(acc, model, opt, 3)
        result["bf16"][name] = {"losses": losses, "compute_dtype": seen[0],
                                "stored_dtype": str(next(acc.unwrap_model(model).parameters()).dtype)}
    acc = Accelerator(strategy="fsdp", seed=0, mixed_precision="fp16",
                      config={"fsdp": {"transformer_layer_cls_to_wrap": ["Block"]}})
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    losses, norms = train(acc, model, opt, 3, clip=1.0)
    result["fp16"] = {"scaler": type(acc.precision.scaler).__name__, "losses": losses, "norms": norms,
                      "skipped": acc.optimizer_step_was_skipped}

    if ddp.is_main_process:
        write_json(os.path.join(out, "result_train.json"), result)
    owner.end_training()


if __name__ == "__main__":
    main()
