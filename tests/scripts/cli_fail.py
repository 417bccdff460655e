"""Run by torchbay launch in tests: rank BAD fails (raise, or waits to be killed); the others keep
running collectives, so they fail afterwards of the broken collective (or are stopped)."""
import os
import subprocess
import sys
import time

import torch

from torchbay import Accelerator

out_dir, mode, bad = sys.argv[1], sys.argv[2], int(sys.argv[3])
acc = Accelerator()
rank = acc.process_index
with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
if rank == 0:  # something the script itself started: it must not outlive the job either
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", out_dir])
acc.reduce(torch.ones(1))
if rank == bad and mode == "raise":
    time.sleep(0.5)
    with open(os.path.join(out_dir, "failed_at"), "w") as f:
        f.write(repr(time.time()))
    raise ValueError(f"deliberate failure on rank {rank}")
deadline = time.time() + 120
while time.time() < deadline:  # the killed rank waits here to be killed; the others block in the collective
    acc.reduce(torch.ones(1))
    time.sleep(0.05)
