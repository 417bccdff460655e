"""Worker (2 or 4 processes): Ulysses sequence parallelism on a tiny Llama-style transformers model, built from a
local config, against the unsharded single-process run computed here.

2 processes: ``sp2`` (Accelerate's spelling ParallelismConfig(sp_size=2, sp_backend="deepspeed"), the model's sdpa)
and ``sp2_eager`` (sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")). 4 processes:
``sp2_dp2`` (dp_shard 2 x sp 2), ``sp2_rep2`` (dp_replicate 2 x sp 2: HSDP, the model sharded over sp and
replicated) and ``sp2_tp2`` (sp 2 x tp 2, with 4 key/value heads: each tp rank's 2 split again over sp).
Each run: K AdamW steps (SGD beside tp: :func:`optimizer`) over the same global batches through a prepared
DataLoader of dicts (input_ids, labels); records per step the loss every rank sees, the full gradient after the
first backward, and the weights after K steps. Writes ``result_<world>.json`` (rank 0).
"""

from __future__ import annotations

import json
import os
import sys

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

VOCAB, SEQ, GLOBAL_BATCH, K, LR = 64, 8, 4, 2, 1e-2


#: tensor-parallel plan of the Llama blocks (attention heads and MLP split over tp)
TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
           "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
           "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
           "model.layers.*.mlp.down_proj": "rowwise"}


def make_model(attn: str = "sdpa", kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (K * GLOBAL_BATCH, SEQ), generator=g)
        self.labels = self.ids.clone()
        # ignored labels on every other row: the sp ranks hold unequal label counts (the loss is their token-weighted
        # mean) while the dp ranks hold equal ones (FSDP averages their gradients as a mean of per-rank means)
        self.labels[::2, -3:] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def optimizer(model, tp: bool):
    """AdamW; SGD beside tp: AdamW's first steps divide each gradient element by its own magnitude, so elements whose
    gradient is near 0 turn the 1e-8 differences of tp's summation order into weight differences of 1e-4 (measured:
    gradients equal to 3e-8, AdamW weights to 1.1e-4, SGD weights to 1.2e-7)."""
    return torch.optim.SGD(model.parameters(), lr=0.5) if tp else torch.optim.AdamW(model.parameters(), lr=LR)


def reference(attn: str, kv_heads: int, tp: bool):
    model = make_model(attn, kv_heads)
    opt = optimizer(model, tp)
    data = Tokens()
    losses, grads = [], None
    for step in range(K):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = model(input_ids=data.ids[sl], labels=data.labels[sl]).loss
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(name: str, pc_kwargs: dict, attn: str) -> dict:
    from torchbay import Accelerator, DeepSpeedSequenceParallelConfig, ParallelismConfig

    if "eager" in name:
        pc_kwargs = {**pc_kwargs, "sp_handler": DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")}
    kv_heads = 4 if pc_kwargs.get("tp_size", 1) > 1 else 2
    if pc_kwargs.get("tp_size", 1) > 1:
        pc_kwargs = {**pc_kwargs, "tp_plan": TP_PLAN}
    ref_losses, ref_grads, ref_state = reference(attn, kv_heads, kv_heads == 4)
    acc = Accelerator(strategy="fsdp", parallelism_config=ParallelismConfig(**pc_kwargs))
    dp = acc.strategy.data_parallel_size
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=GLOBAL_BATCH // dp)
    model = make_model(attn, kv_heads)
    opt = optimizer(model, kv_heads == 4)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, grad_diff, shapes = [], None, None
    for batch in loader:
        shapes = {k: list(v.shape) for k, v in batch.items()}
        loss = model(**batch).loss
        acc.backward(loss)
        if grad_diff is None:
            grads = {n: full(p.grad) for n, p in model.named_parameters()}
            grad_diff = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach()[None]).tolist())  # every rank's loss
    state = {k: full(v) for k, v in model.state_dict().items()}
    weight_diff = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    return {"losses": losses, "reference_losses": ref_losses, "grad_diff": grad_diff, "weight_diff": weight_diff,
            "batch_shapes": shapes, "mesh": list(acc.torch_device_mesh.mesh_dim_names),
            "attn": model.config._attn_implementation, "sp_backend": acc.parallelism_config.sp_backend}


def main():
    from torchbay import Accelerator

    owner = Accelerator(strategy="ddp")
    world = owner.num_processes
    runs = ({"sp2": ({"sp_size": 2, "sp_backend": "deepspeed"}, "sdpa"),
             "sp2_eager": ({"sp_size": 2}, "eager")} if world == 2 else
            {"sp2_dp2": ({"sp_size": 2, "dp_shard_size": 2}, "sdpa"),
             "sp2_rep2": ({"sp_size": 2, "dp_replicate_size": 2}, "sdpa"),
             "sp2_tp2": ({"sp_size": 2, "tp_size": 2}, "sdpa")})
    result = {name: run(name, kwargs, attn) for name, (kwargs, attn) in runs.items()}
    if owner.is_main_process:
        with open(os.path.join(sys.argv[sys.argv.index("--out") + 1], f"result_{world}.json"), "w") as f:
            json.dump(result, f)
    owner.end_training()


if __name__ == "__main__":
    main()
