"""Run every benchmark under benchmarks/ one after the other (each prints its own side-by-side table)."""

import glob
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
failed = []
for path in sorted(glob.glob(os.path.join(here, "bench_*.py"))):
    print(f"\n=== {os.path.basename(path)} ===", flush=True)
    if subprocess.run([sys.executable, path]).returncode != 0:
        failed.append(os.path.basename(path))
if failed:
    sys.exit(f"benchmarks that failed: {', '.join(failed)}")
