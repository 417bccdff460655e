"""Run by torchbay launch in tests: each rank reports itself and checks a real collective."""
import json
import os
import sys

import torch

from torchbay import Accelerator

out_dir = sys.argv[1]
acc = Accelerator()
total = acc.reduce(torch.tensor([float(acc.process_index)]), "sum").item()
record = {"rank": acc.process_index, "world": acc.num_processes, "local_rank": acc.local_process_index,
          "pid": os.getpid(), "ppid": os.getppid(), "sum": total, "argv": sys.argv[2:],
          "mixed_precision": acc.mixed_precision, "gradient_accumulation_steps": acc.gradient_accumulation_steps,
          "seed": acc.config.seed, "seed_source": acc.context.resolved.source_of("seed"),
          "steps_source": acc.context.resolved.source_of("gradient_accumulation_steps"),
          "strategy": acc.strategy.name, "has_resolved_env": "TORCHBAY_RESOLVED_CONFIG" in os.environ,
          "fake_env": os.environ.get("CLI_TEST_FAKE_ENV")}
with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
    json.dump(record, f)
