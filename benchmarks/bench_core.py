"""Core overhead beside raw PyTorch and Accelerate, in one run (1 process, 1 thread):

- the training step of a small MLP (3 x Linear(256), batch 32, AdamW): plain, with gradient
  accumulation 4, with bf16 autocast (fp32 outputs); the same on a width-1 model, where
  nothing but the framework's own per-step cost takes time;
- a prepared DataLoader epoch (200k samples, batch 64);
- start-up: ``import torch`` + ``Accelerator()`` in a fresh interpreter vs ``import torch``.

Every training loop starts from the same seed and data; the weights it ends with must be
bit-identical to the raw loop's (the benchmark stops if torchbay's are not, and notes it for
Accelerate). Accelerate is a contender when it is installed.

    python benchmarks/bench_core.py [--steps 300] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Path, accelerate_available, child_env, interleaved, python_child, report, reset_accelerate, timed  # noqa: E402

BATCH = 32


def make_model(width: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_loader(steps: int, width: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(steps * BATCH, width, generator=g), torch.randn(steps * BATCH, width, generator=g))
    return DataLoader(data, batch_size=BATCH, shuffle=False)


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class StepLoops:
    """The same training loop written three ways; each returns (seconds, final weights)."""

    def __init__(self, steps: int, width: int, accumulation: int, bf16: bool):
        self.steps, self.width, self.accumulation, self.bf16 = steps, width, accumulation, bf16

    def raw(self):
        model, opt = make_model(self.width)
        loader = make_loader(self.steps, self.width)
        accumulation, bf16 = self.accumulation, self.bf16

        def loop():
            for i, (x, y) in enumerate(loader):
                if bf16:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(x)
                else:
                    out = model(x)
                loss = torch.nn.functional.mse_loss(out.float(), y) / accumulation
                loss.backward()
                if (i + 1) % accumulation == 0:
                    opt.step()
                    opt.zero_grad()
        return timed(loop), weights(model)

    def _framework(self, acc):
        model, opt = make_model(self.width)
        model, opt, loader = acc.prepare(model, opt, make_loader(self.steps, self.width))

        def loop():
            for x, y in loader:
                with acc.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                    acc.backward(loss)
                    opt.step()
                    opt.zero_grad()
        seconds = timed(loop)
        acc.end_training()
        return seconds, weights(model)

    def accelerate(self):
        import accelerate

        reset_accelerate()
        return self._framework(accelerate.Accelerator(gradient_accumulation_steps=self.accumulation, cpu=True,
                                                      mixed_precision="bf16" if self.bf16 else "no"))

    def torchbay(self):
        import torchbay

        return self._framework(torchbay.Accelerator(gradient_accumulation_steps=self.accumulation, cpu=True,
                                                    mixed_precision="bf16" if self.bf16 else "no"))


def step_path(name: str, loops: StepLoops, contenders: list[str], rounds: int, target: str) -> Path:
    reference = loops.raw()[1]
    differs: set[str] = set()

    def run(contender):
        def once():
            seconds, final = getattr(loops, contender)()
            if any(not torch.equal(a, b) for a, b in zip(final, reference)):
                differs.add(contender)
            return seconds
        return once

    values = interleaved({c: run(c) for c in contenders}, rounds)
    if "torchbay" in differs:
        raise SystemExit(f"{name}: torchbay's weights after {loops.steps} steps differ from the raw loop's")
    note = "Accelerate's weights differ from raw's" if "accelerate" in differs else ""
    return Path(name, values, target=target, note=note)


def dataloader_path(contenders: list[str], rounds: int, samples: int = 200_000, batch: int = 64) -> Path:
    g = torch.Generator().manual_seed(2)
    dataset = TensorDataset(torch.randn(samples, 16, generator=g), torch.randint(0, 10, (samples,), generator=g))

    def epoch(loader) -> float:
        def go():
            total = 0
            for x, _ in loader:
                total += x.shape[0]
            assert total == samples, total
        return timed(go)

    def raw():
        return epoch(DataLoader(dataset, batch_size=batch, shuffle=True))

    def accelerate_epoch():
        import accelerate

        reset_accelerate()
        return epoch(accelerate.Accelerator(cpu=True).prepare(DataLoader(dataset, batch_size=batch, shuffle=True)))

    def torchbay_epoch():
        import torchbay

        return epoch(torchbay.Accelerator(cpu=True).prepare(DataLoader(dataset, batch_size=batch, shuffle=True)))

    runs = {"raw": raw, "accelerate": accelerate_epoch, "torchbay": torchbay_epoch}
    return Path(f"prepared DataLoader epoch ({samples // 1000}k samples, batch {batch})",
                interleaved({c: runs[c] for c in contenders}, rounds), target="<= 1.01x")


STARTUP = {
    "raw": "import torch",
    # torch's import leaves a full garbage collection due (about 0.1 s here, over its ~170k
    # objects) that the next ~2,000 allocations of any script set off; this baseline pays it too
    "raw+gc": "import torch; _ = [[] for _ in range(5000)]",
    "accelerate": "import torch; from accelerate import Accelerator; Accelerator()",
    "torchbay": "import torch; from torchbay import Accelerator; Accelerator()",
}


def startup_paths(contenders: list[str], rounds: int) -> list[Path]:
    """Wall time of a fresh interpreter that runs the statement (bytecode cached, as installed)."""
    env = child_env()
    for key in [k for k in env if k.startswith(("TORCHBAY_", "ACCELERATE_"))]:
        env.pop(key)

    def run(statement):
        return lambda: timed(lambda: python_child(statement, env=env))

    values = interleaved({c: run(STARTUP[c]) for c in ["raw", "raw+gc", *contenders[1:]]}, rounds, warmup=2)
    frameworks = {c: values[c] for c in contenders[1:]}
    return [Path("`import torch` + `Accelerator()`, fresh interpreter, vs `import torch`",
                 {"raw": values["raw"], **frameworks}, target="<= 1.05x"),
            Path("the same vs `import torch` + 5,000 allocations (the garbage collection torch leaves due)",
                 {"raw": values["raw+gc"], **frameworks}, target="<= 1.05x")]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    contenders = ["raw", "torchbay"] + (["accelerate"] if accelerate_available() else [])
    paths = []
    for name, accumulation, bf16, target in [("plain", 1, False, "<= 1.02x"),
                                              ("grad accumulation 4", 4, False, "<= 1.02x"),
                                              ("bf16 autocast", 1, True, "<= 1.02x")]:
        paths.append(step_path(f"training step, small MLP, {name}", StepLoops(args.steps, 256, accumulation, bf16),
                               contenders, args.rounds, target))
    for name, accumulation, bf16 in [("plain", 1, False), ("grad accumulation 4", 4, False), ("bf16", 1, True)]:
        paths.append(step_path(f"framework's own cost: width-1 model, {name}",
                               StepLoops(args.steps, 1, accumulation, bf16), contenders, args.rounds, ""))
    paths.append(dataloader_path(contenders, max(3, args.rounds // 2)))
    paths += startup_paths(contenders, args.rounds)
    report("Core: training step, data loading, start-up (1 process, 1 thread)", paths, rounds=args.rounds,
           description=f"{args.steps} steps per loop; weights after the loop are bit-identical to the raw loop's "
                       "(checked every round). The width-1 rows show the framework's own per-step cost: "
                       "there the model takes almost no time. The DataLoader row runs "
                       f"{max(3, args.rounds // 2)} rounds. Start-up runs each statement in a fresh interpreter "
                       "with bytecode cached (as an installed package has it); the second start-up row's baseline "
                       "also pays the full garbage collection that `import torch` leaves due, which the first "
                       "~2,000 allocations of any script set off (about 0.1 s here).")


if __name__ == "__main__":
    main()
