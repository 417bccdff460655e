"""The numerics table of ``bench_fp8.py --numerics``: per recipe, how far training strays from bf16, and how much
each cast loses per layer type. Emulated (torchao, ``fp8.emulate: true``), so it runs on any device, the CPU
included; it measures numerics only, never speed.

1. Loss gap: a small GPT (token embedding, pre-norm blocks with QKV, attention projection and a 4x GELU MLP, a
   head) trains ``--steps`` AdamW steps on one fixed next-token batch, from the same weights, in bf16 and in each
   recipe with the default per-layer policy (first Linear and the head in bf16). The gap is the relative
   difference of the mean loss over the last 3 steps.
2. Quantization error: the weights of each Linear and the activations that reach it (one forward of the batch,
   in fp32), each cast to the recipe's format and back; the number is ``||q(t) - t|| / ||t||``, averaged over the
   blocks, per layer type. tensorwise: one E4M3 scale per tensor; rowwise: one E4M3 scale per row (along the
   reduction dimension, as torchao's rowwise recipe scales its operands); mxfp8 / mxfp4: torchao's MX casts
   (blocks of 32, E8M0 scales).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchbay import Accelerator

RECIPES = {"tensorwise": ("fp8", {}), "rowwise": ("fp8", {"recipe": "rowwise"}), "mxfp8": ("fp8", {"recipe": "mxfp8"}),
           "mxfp4": ("fp4", {"recipe": "mxfp4"})}
LAYER_TYPES = ("qkv", "proj", "fc1", "fc2", "head")
E4M3_MAX = 448.0


class Block(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.heads = max(1, hidden // 64)
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class SmallGPT(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, blocks: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _batch(vocab: int, batch: int, seq: int):
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def train(mode: str, fp8: dict, args) -> list[float]:
    config = {"fp8": {"emulate": True, **fp8}} if mode in ("fp8", "fp4") else {}
    acc = Accelerator(mixed_precision=mode, device="cpu", config=config)
    torch.manual_seed(0)
    model = SmallGPT(args.vocab, args.hidden, args.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = acc.prepare(model, optimizer)
    inputs, targets = _batch(args.vocab, args.batch, args.seq)
    losses = []
    for _ in range(args.steps):
        with acc.autocast():
            loss = F.cross_entropy(model(inputs).float().reshape(-1, args.vocab), targets.reshape(-1))
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def cast(tensor: torch.Tensor, recipe: str) -> torch.Tensor:
    """``tensor`` (2-D, fp32) through ``recipe``'s format and back."""
    if recipe in ("mxfp8", "mxfp4"):
        from torchbay_fp8_torchao.mx import quantize_dequantize

        return quantize_dequantize(tensor, recipe)
    amax = tensor.abs().amax() if recipe == "tensorwise" else tensor.abs().amax(dim=-1, keepdim=True)
    scale = E4M3_MAX / amax.clamp(min=1e-12)
    return (tensor * scale).to(torch.float8_e4m3fn).float() / scale


def quantization_errors(args) -> dict[str, dict[str, tuple[float, float]]]:
    """``{recipe: {layer type: (weight error, activation error)}}`` on the initial weights."""
    torch.manual_seed(0)
    model = SmallGPT(args.vocab, args.hidden, args.blocks)
    seen: dict[str, list[tuple[torch.nn.Linear, torch.Tensor]]] = {t: [] for t in LAYER_TYPES}

    def hook(kind):
        def keep(module, inputs, output):
            seen[kind].append((module, inputs[0].detach().reshape(-1, module.in_features)))
        return keep

    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and kind in seen:
            module.register_forward_hook(hook(kind))
    with torch.no_grad():
        model(_batch(args.vocab, args.batch, args.seq)[0])
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for recipe in RECIPES:
        out[recipe] = {}
        for kind, pairs in seen.items():
            w = [_rel(cast(m.weight.detach().float(), recipe), m.weight.detach().float()) for m, _ in pairs]
            a = [_rel(cast(x.float(), recipe), x.float()) for _, x in pairs]
            out[recipe][kind] = (sum(w) / len(w), sum(a) / len(a))
    return out


def _rel(q: torch.Tensor, t: torch.Tensor) -> float:
    return ((q - t).norm() / t.norm().clamp(min=1e-12)).item()


def numerics_table(args) -> str:
    """The two markdown tables (loss gap, quantization error), with the set-up they were measured on."""
    base = train("bf16", {}, args)
    lines = [f"Small GPT: vocab {args.vocab}, hidden {args.hidden}, {args.blocks} blocks, {args.batch}x{args.seq} "
             f"tokens, {args.steps} AdamW steps (lr {args.lr:g}), emulated on CPU; bf16 final loss "
             f"{base[-1]:.4f}.", "", "| recipe | mode | final loss | loss gap to bf16 (last 3 steps) |",
             "|---|---|---:|---:|"]
    for recipe, (mode, fp8) in RECIPES.items():
        losses = train(mode, fp8, args)
        gap = (sum(losses[-3:]) - sum(base[-3:])) / sum(base[-3:])
        lines.append(f"| {recipe} | {mode} | {losses[-1]:.4f} | {gap:+.2%} |")
    errors = quantization_errors(args)
    lines += ["", "Relative quantization error ||q(t) - t|| / ||t|| of the weights (w) and of the activations "
              "reaching them (a), initial weights, averaged over the blocks:", "",
              "| recipe | " + " | ".join(f"{t} w | {t} a" for t in LAYER_TYPES) + " |",
              "|---|" + "---:|" * (2 * len(LAYER_TYPES))]
    for recipe, per_type in errors.items():
        cells = " | ".join(f"{w:.4f} | {a:.4f}" for w, a in (per_type[t] for t in LAYER_TYPES))
        lines.append(f"| {recipe} | {cells} |")
    return "\n".join(lines)
