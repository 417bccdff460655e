"""A tiny training run that logs through the selected trackers, for tracker plugins' tests.

Run it directly (one process) or with :func:`torchbay.testing.processes.run_torchrun`::

    run_torchrun(tracking_run.__file__, 2, ["--project-dir", d, "--log-with", "jsonl,mytracker"])

Each step logs ``loss`` (a tensor, ``1 + 0.5 * step``), ``acc`` (a numpy float32, ``0.25 *
step``) and ``nested/count`` (a numpy int, ``step``), without passing ``step``: the
accelerator's counter numbers them, and after ``--resume`` (``load_state``) they continue.
``init_trackers`` gets :data:`CONFIG` (nested, with a tensor and a numpy int). Every rank
writes ``result_rank<r>.json``: the trackers it ran and its step counter at the end.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from torchbay import Accelerator

#: what init_trackers records; a reader should find lr=0.1, model/width=4, model/depth=2, seed=7, name="tiny"
CONFIG = {"lr": 0.1, "model": {"width": 4, "depth": torch.tensor(2)}, "seed": np.int64(7), "name": "tiny"}


def expected_values(step: int) -> dict[str, float]:
    """The flattened scalars logged at ``step``."""
    return {"loss": 1.0 + 0.5 * step, "acc": 0.25 * step, "nested/count": float(step)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--project-dir", required=True)
    p.add_argument("--log-with", default="jsonl")
    p.add_argument("--run-name", default="tiny")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--resume", action="store_true", help="load_state from <project-dir>/state first")
    p.add_argument("--init-kwargs", default="{}", help="JSON for init_trackers(init_kwargs=...)")
    args = p.parse_args(argv)

    accelerator = Accelerator(project_dir=args.project_dir, log_with=args.log_with.split(","))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers(args.run_name, config=CONFIG, init_kwargs=json.loads(args.init_kwargs))
    state_dir = os.path.join(args.project_dir, "state")
    if args.resume:
        accelerator.load_state(state_dir)
    first = accelerator.tracker_step
    for step in range(first, first + args.steps):
        loss = model(torch.ones(4, 2)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        values = expected_values(step)
        accelerator.log({"loss": torch.tensor(values["loss"]), "acc": np.float32(values["acc"]),
                         "nested": {"count": np.int64(step)}})
    trackers = [t.name for t in accelerator.trackers]
    accelerator.save_state(state_dir)
    accelerator.end_training()
    result = {"rank": accelerator.process_index, "trackers": trackers, "first_step": first,
              "tracker_step": accelerator.tracker_step}
    with open(os.path.join(args.project_dir, f"result_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
