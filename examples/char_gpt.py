"""Train a small GPT-style character model on the Python standard library's own sources.

Every machine with Python has this text, so nothing is downloaded. Run it through
`torchbay launch` (any number of processes, any installed device/strategy/precision):

    torchbay launch --num-processes 2 examples/char_gpt.py --output-dir runs/char_gpt
    torchbay launch --num-processes 2 examples/char_gpt.py --output-dir runs/char_gpt --resume --epochs 4

The second command loads the saved state and continues with the next epoch. The script is
a plain PyTorch loop; only the `accelerator.*` lines are torchbay.

Training and eval loss are logged through the built-in `jsonl` tracker and TensorBoard when
torchbay-tensorboard is installed (`--log-with` chooses others), under
`<output-dir>/logs/<tracker>/char_gpt`; `torchbay plot <output-dir>` draws them.
"""

import argparse
import logging
import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from torchbay import Accelerator, get_logger, set_seed, tqdm
from torchbay.tracking.trackers import registered

logger = get_logger(__name__, log_level="INFO")


def stdlib_text(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


class Windows(Dataset):
    """Fixed windows of ``block + 1`` bytes: inputs are the first ``block``, targets the shifted ones."""

    def __init__(self, data: torch.Tensor, block: int, count: int):
        self.data, self.block = data, block
        self.starts = torch.linspace(0, len(data) - block - 2, count).long()

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        chunk = self.data[self.starts[i]: self.starts[i] + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int = 256, block: int = 64, width: int = 96, layers: int = 2, heads: int = 4):
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((block, block), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        return self.head(self.ln(x))

    @torch.no_grad()
    def generate(self, idx, new_tokens: int, temperature: float = 0.8):
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block:])[:, -1].float() / temperature
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, -1), 1)], 1)
        return idx


class EpochsDone:
    """How many epochs are finished: registered for checkpointing, so a resumed run continues after them."""

    def __init__(self):
        self.epochs = 0

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = int(state["epochs"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="runs/char_gpt")
    p.add_argument("--epochs", type=int, default=2, help="total epochs (a resumed run continues up to this)")
    p.add_argument("--resume", action="store_true", help="load the saved state and continue")
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--train-windows", type=int, default=4096)
    p.add_argument("--text-bytes", type=int, default=600_000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-with", default=None, help="trackers, comma-separated (default: jsonl, and tensorboard "
                   "when installed)")
    args = p.parse_args()
    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)

    trackers = args.log_with.split(",") if args.log_with else [t for t in ("jsonl", "tensorboard") if t in registered()]
    accelerator = Accelerator(project_dir=args.output_dir, log_with=trackers)
    set_seed(0)
    data = torch.frombuffer(bytearray(stdlib_text(args.text_bytes)), dtype=torch.uint8).long()
    split = int(0.9 * len(data))
    train = Windows(data[:split], 64, args.train_windows)
    val = Windows(data[split:], 64, 256)
    model = CharGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val, batch_size=64)
    warmup = 30  # a schedule with no fixed length, so a resumed run may train for more epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler)

    state_dir = os.path.join(args.output_dir, "state")
    progress = EpochsDone()
    accelerator.register_for_checkpointing(progress)  # saved and restored with the rest of the state
    accelerator.init_trackers("char_gpt", config={"model": {"block": 64, "width": 96, "layers": 2, "heads": 4},
                                                  "lr": args.lr, "batch_size": args.batch_size,
                                                  "processes": accelerator.num_processes,
                                                  "mixed_precision": accelerator.mixed_precision})
    if args.resume:
        accelerator.load_state(state_dir)
    start_epoch = progress.epochs
    if args.resume:
        logger.info(f"resumed from {state_dir}: continuing at epoch {start_epoch + 1} of {args.epochs}")
    logger.info(f"{accelerator.num_processes} process(es) on {accelerator.device}, strategy "
                f"{accelerator.distributed_type}, precision {accelerator.mixed_precision}; "
                f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(data):,} bytes of text")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}")
        for batch, (inputs, targets) in enumerate(bar):
            with accelerator.accumulate(model):
                logits = model(inputs)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            step = epoch * len(train_loader) + batch + 1  # optimizer steps so far, the same after a resume
            accelerator.log({"train/loss": loss, "train/lr": scheduler.get_last_lr()[0]}, step=step)
        model.eval()
        losses = []
        with torch.no_grad():
            for inputs, targets in val_loader:
                logits = model(inputs)
                per_sample = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none").mean(1)
                losses.append(accelerator.gather_for_metrics(per_sample))
        val_loss = torch.cat(losses).mean().item()
        logger.info(f"epoch {epoch + 1}: eval loss {val_loss:.3f} ({val_loss / math.log(2):.2f} bits/char)")
        accelerator.log({"eval/loss": val_loss, "eval/bits_per_char": val_loss / math.log(2)},
                        step=(epoch + 1) * len(train_loader))
        progress.epochs = epoch + 1

    accelerator.save_state(state_dir)
    # every process generates: a sharded model's (--strategy fsdp) forward gathers its parameters from all of them
    prompt = torch.tensor([list(b"def ")], device=accelerator.device)
    torch.manual_seed(0)
    sample = accelerator.unwrap_model(model).generate(prompt, 160)
    if accelerator.is_main_process:
        print("--- sample ---\n" + bytes(sample[0].tolist()).decode("utf-8", "replace"))
    logger.info(f"state saved to {state_dir}")
    for tracker in accelerator.trackers:
        logger.info(f"{tracker.name} logs: {tracker.location}")
    if accelerator.trackers:
        logger.info(f"draw them: torchbay plot {args.output_dir}")
    accelerator.end_training()  # also closes the trackers' files


if __name__ == "__main__":
    main()
