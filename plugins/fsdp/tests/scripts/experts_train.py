"""Worker (2 or 4 processes): expert parallelism on a small torchtitan-style MoE transformer (and, with 2
processes, a tiny transformers Mixtral built from a local config) against the ep 1 single-process run.

2 processes: ``ep2`` (dp_shard 2, ep 2: each rank holds half of the experts, whole) and ``mixtral_ep2``.
4 processes: ``ep2_dp2`` (dp_shard 4, ep 2: each half of the experts sharded by FSDP2 over 2 ranks).
Each run: K AdamW steps over the same global batches (a prepared DataLoader; each rank reads its own share);
records the mean loss per step, the largest weight difference after K steps (expert weights gathered over ep),
the tokens per expert, and a save_state / load_state round trip; Mixtral's load-balancing loss at the first step
against one process without ep. Writes ``result_<world>.json`` (rank 0).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

VOCAB, DIM, HEADS, SEQ, GLOBAL_BATCH, EXPERTS, TOP_K, K, LR = 32, 16, 2, 6, 8, 4, 2, 3, 1e-2


class GroupedExperts(nn.Module):
    """torchtitan's layout: 3-D w1/w2/w3, experts first; rows arrive sorted by expert."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) * 0.2)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * DIM) * 0.2)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) * 0.2)

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            outs.append((nn.functional.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)) @ self.w2[e].T)
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = GroupedExperts()

    def forward(self, x):
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        weights, chosen = torch.softmax(self.router(tokens), dim=-1).topk(TOP_K, dim=-1)
        slots = chosen.reshape(-1)
        order = torch.argsort(slots, stable=True)
        out = self.experts(tokens[order // TOP_K], torch.bincount(slots, minlength=EXPERTS))
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(tokens).index_add_(0, order // TOP_K, out).view(b, s, d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # no bias on q/k/v: a key bias's gradient is 0 up to rounding, which Adam turns into ~lr updates
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.moe = MoE()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(y)
        return x + self.moe(self.norm2(x))


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_model(kind: str):
    torch.manual_seed(0)
    if kind == "tiny":
        return TinyMoE()
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, max_position_embeddings=32, router_aux_loss_coef=0.02)
    return MixtralForCausalLM(config)


def batches():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (K * GLOBAL_BATCH, SEQ + 1), generator=g)


def loss_of(model, kind, ids):
    if kind == "tiny":
        logits = model(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return model(input_ids=ids, labels=ids).loss


def reference(kind):
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data, losses, grads = batches(), [], None
    for step in range(K):
        loss = loss_of(model, kind, data[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_state(acc, items):
    """Every tensor whole: FSDP shards gathered, each expert weight gathered over the ep group."""
    group = acc.strategy._expert_mesh["ep"].get_group()
    ep = dist.get_world_size(group)
    state = {}
    for name, value in items:
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if value.ndim == 3:  # an expert weight: this rank's experts
            parts = [torch.empty_like(value) for _ in range(ep)]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts)
        state[name] = value
    return state


def load_balancing_loss(acc, model, ids) -> dict:
    """Mixtral's load-balancing (aux) loss and its total loss (cross entropy + 0.02 x aux) on this rank's batch,
    with ep and in one process without it, the largest difference over the ranks (the router logits cover every
    expert under ep too). A forward without gradients; the expert load counted by it is dropped."""
    from torchbay_fsdp.experts import tokens_per_expert

    with torch.no_grad():
        got = model(input_ids=ids, labels=ids, output_router_logits=True)
        ref = make_model("mixtral")(input_ids=ids, labels=ids, output_router_logits=True)
    tokens_per_expert(model)  # reset
    diffs = torch.tensor([(got.aux_loss - ref.aux_loss).abs().item(), (got.loss - ref.loss).abs().item()])
    return {"aux_loss": got.aux_loss.item(), "aux_diff": acc.gather(diffs[None])[:, 0].max().item(),
            "loss_diff": acc.gather(diffs[None])[:, 1].max().item()}


def checkpoint_round_trip(acc, model, state: dict, whole: dict, kind: str) -> dict:
    """save_state, then load_state into the same model: the weights after it (whole, experts gathered) against
    ``state``; and the checkpoint's model read back in one process (merge-weights' reader) against ``whole``
    (accelerator.get_state_dict on rank 0)."""
    from torchbay_fsdp.merge import load_full_state_dict

    path = os.path.join(sys.argv[sys.argv.index("--out") + 1], f"ckpt_{kind}")
    acc.save_state(path)
    acc.load_state(path)
    reloaded = full_state(acc, model.state_dict().items())
    result = {"reload_max_diff": max((reloaded[k] - v).abs().max().item() for k, v in state.items())}
    if acc.is_main_process:
        merged = load_full_state_dict(path)
        result.update(merged_keys_match=sorted(merged) == sorted(whole),
                      merged_max_diff=max((merged[k] - v).abs().max().item() for k, v in whole.items()))
    return result


def run(kind: str, sizes: dict) -> dict:
    from torchbay_fsdp.experts import tokens_per_expert

    from torchbay import Accelerator, ParallelismConfig

    ref_losses, ref_grads, ref_state = reference(kind)
    acc = Accelerator(strategy="fsdp", parallelism_config=ParallelismConfig(**sizes))
    dp = acc.strategy.data_parallel_size
    loader = torch.utils.data.DataLoader(batches(), batch_size=GLOBAL_BATCH // dp)
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, grads, aux = [], None, None
    for ids in loader:
        if kind == "mixtral" and aux is None:
            aux = load_balancing_loss(acc, model, ids)
        loss = loss_of(model, kind, ids)
        acc.backward(loss)
        if grads is None:
            grads = full_state(acc, [(n, p.grad) for n, p in model.named_parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(acc.gather(loss.detach()[None]).mean().item())
    load = tokens_per_expert(model)
    state = full_state(acc, model.state_dict().items())
    local_experts = {n: list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape)
                     for n, p in model.named_parameters() if p.ndim == 3}
    whole = acc.get_state_dict(model)  # rank 0: every expert, original names
    saved = {"keys_match": sorted(whole) == sorted(ref_state),
             "max_diff": max((whole[k] - v).abs().max().item() for k, v in ref_state.items())} \
        if acc.is_main_process else None
    return {"losses": losses, "reference_losses": ref_losses, "full_state_dict": saved,
            "save_state": checkpoint_round_trip(acc, model, state, whole, kind), "aux": aux,
            "grad_diff": max((grads[k] - v).abs().max().item() for k, v in ref_grads.items()),
            "grad_report": {k: [(grads[k] - v).abs().max().item(), grads[k].norm().item() / v.norm().item()]
                            for k, v in ref_grads.items() if (grads[k] - v).abs().max().item() > 1e-6},
            "weight_diff": max((state[k] - v).abs().max().item() for k, v in ref_state.items()),
            "worst_weight": max(ref_state, key=lambda k: (state[k] - ref_state[k]).abs().max().item()),
            "tokens_per_expert": load, "local_expert_shapes": local_experts}


def main():
    from torchbay import Accelerator

    owner = Accelerator(strategy="ddp")
    world = owner.num_processes
    runs = ({"ep2": ("tiny", {"dp_shard_size": 2, "ep_size": 2}),
             "mixtral_ep2": ("mixtral", {"dp_shard_size": 2, "ep_size": 2})} if world == 2 else
            {"ep2_dp2": ("tiny", {"dp_shard_size": 4, "ep_size": 2})})
    result = {name: run(kind, sizes) for name, (kind, sizes) in runs.items()}
    if owner.is_main_process:
        with open(os.path.join(sys.argv[sys.argv.index("--out") + 1], f"result_{world}.json"), "w") as f:
            json.dump(result, f)
    owner.end_training()


if __name__ == "__main__":
    main()
