"""A tiny training run with telemetry on, for tracker plugins' tests: which metric names reach a tracker at which
steps (docs/telemetry.md).

:func:`train` runs :data:`STEPS` optimizer steps of a small token model over a prepared loader with
``telemetry.every_n_steps = EVERY``: the first step's record is logged at step 1 (:data:`FIRST_STEP`) and the
windows' at steps 3 (:data:`WINDOW`). A tracker plugin's test reads its own store back and checks the names.
Under ``torchrun`` every rank's memory is logged (``memory/rank<R>/...``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from torchbay import Accelerator

STEPS, EVERY = 4, 3
#: names logged at step 1 (the counting step)
FIRST_STEP = ("flops/counted_per_step", "flops/6nt_per_step", "memory/estimate_gib", "memory/rank0/current_gib",
              "memory/rank0/peak_gib")
#: names logged at step 3 (a window); no MFU: the cpu's peak is unknown
WINDOW = ("time/step_time_s", "time/data_wait_s", "throughput/samples_per_s", "throughput/tokens_per_s",
          "throughput/tflops", "memory/rank0/current_gib", "memory/rank0/peak_gib")


class _TokenModel(torch.nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids):
        logits = self.head(self.embed(input_ids))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())


def train(project_dir: str, log_with: str, run_name: str = "telemetry", **accelerator_kwargs: Any) -> Accelerator:
    """:data:`STEPS` steps with telemetry on, logged through ``log_with``; ends the run (trackers finished)."""
    config = dict(accelerator_kwargs.pop("config", {}) or {})
    config["telemetry"] = {"enabled": True, "every_n_steps": EVERY}
    acc = Accelerator(project_dir=project_dir, log_with=log_with, device="cpu", config=config, **accelerator_kwargs)
    data = [{"input_ids": torch.arange(8) % 32} for _ in range(STEPS * 2 * 4)]  # enough for 4 processes
    model = _TokenModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=2))
    acc.init_trackers(run_name, config={"steps": STEPS})
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        acc.backward(model(**batch))
        optimizer.step()
        optimizer.zero_grad()
    acc.end_training()
    return acc


def main(argv: list[str] | None = None) -> None:
    """``python telemetry_run.py --project-dir D [--log-with jsonl]``, alone or under torchrun."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--project-dir", required=True)
    parser.add_argument("--log-with", default="jsonl")
    args = parser.parse_args(argv)
    train(args.project_dir, args.log_with)


if __name__ == "__main__":
    main()
