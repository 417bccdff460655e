"""Run by torchbay launch in tests: every rank prints many lines at once, to stdout and stderr,
each with ``print(..., flush=True)``; the launcher's output must keep every line whole."""
import sys

from torchbay import Accelerator

acc = Accelerator()
rank, world = acc.process_index, acc.num_processes
acc.wait_for_everyone()  # start printing together
for i in range(int(sys.argv[1])):
    print(f"RANKLINE {rank}/{world} line {i:05d} " + "x" * (i % 64), flush=True)
    print(f"ERRLINE {rank}/{world} line {i:05d}", file=sys.stderr, flush=True)
