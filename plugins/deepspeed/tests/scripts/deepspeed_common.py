"""Shared pieces of the deepspeed worker scripts: a small model, fixed data, one training loop."""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

torch.set_num_threads(1)

IN, WIDTH, OUT, BATCH = 8, 32, 4, 4


class Net(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.inp = nn.Linear(IN, width)
        self.norm = nn.LayerNorm(width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, OUT)

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.norm(torch.tanh(self.inp(x))))))


def dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, IN, generator=g)
    y = torch.randn(n, OUT, generator=g)
    return TensorDataset(x, y)


def init_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def train(strategy: str, ga: int, micro_steps: int, config: dict | None = None, clip: float | None = None,
          json_optimizer: bool = False, lr: float = 1e-2):
    """Run ``micro_steps`` micro-batches with the usual torchbay loop; return losses, norms, weights."""
    from torchbay import Accelerator, set_seed

    set_seed(0)
    acc = Accelerator(strategy=strategy, gradient_accumulation_steps=ga, config=dict(config or {}))
    torch.manual_seed(0)
    model = Net()
    loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False)
    if json_optimizer:
        from torchbay_deepspeed import DummyOptim, DummyScheduler

        opt = DummyOptim(model.parameters(), lr=lr, weight_decay=0.01)
        sched = DummyScheduler(opt, warmup_num_steps=3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    t0 = time.perf_counter()
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    prepare_s = time.perf_counter() - t0
    losses, norms, lrs = [], [], []
    dtype = next(acc.unwrap_model(model).parameters()).dtype  # DeepSpeed bf16/fp16 converts the module
    done = 0
    while done < micro_steps:
        for x, y in loader:
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
                acc.backward(loss)
                if clip is not None and acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(acc.gather(loss.detach()[None]).mean().item())
            lrs.append(float(sched.get_last_lr()[0]))
            done += 1
            if done == micro_steps:
                break
    state = acc.get_state_dict(model)
    weights = {k: v.float().tolist() for k, v in state.items()} if acc.is_main_process else {}
    info = {"losses": losses, "norms": norms, "lrs": lrs, "weights": weights, "prepare_s": prepare_s}
    strat = acc.strategy
    if strategy == "deepspeed":
        rec = strat.records[0]
        info["config"] = rec.config
        info["report"] = rec.report
        info["engine_optimizer"] = type(rec.engine.optimizer).__name__
        info["base_optimizer"] = type(getattr(rec.engine.optimizer, "optimizer", rec.engine.optimizer)).__name__
        info["param_dtype"] = str(dtype)
        info["precision"] = acc.precision.describe()
    acc.end_training()
    return info


def write(path: str, data) -> None:
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(data, f)
