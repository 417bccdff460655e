"""Run every benchmark under benchmarks/ one after the other and write docs/performance.md.

Each benchmark prints its own side-by-side table. Those written with benchmarks/common.py
(raw, Accelerate and torchbay per path) hand their tables over as markdown; the others'
printed output goes into the document as it is. The document starts with the machine, the
versions and the commit it was measured on.

    python benchmarks/run_all.py [--only core,ddp] [--out docs/performance.md]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import REPO, RESULTS_ENV, machine  # noqa: E402

HEADER = """# Performance

Written by `make bench` (`benchmarks/run_all.py`); do not edit by hand. Every table compares,
in one run on one machine, raw PyTorch (what a user writes by hand), Hugging Face Accelerate
(when installed) and torchbay on the same work. Repetitions are interleaved (the order of the
contenders rotates each round), and each cell is the median ratio to raw with the lowest and
highest ratio of the rounds in brackets: one timing is never reported. Training benchmarks
check that the weights torchbay ends with are bit-identical to the raw loop's.

A shared 2-core virtual machine moves wall times by several percent from round to round; a
ratio whose bracket contains 1.00 is not distinguishable from raw here.
"""


def run(path: str, results: str) -> tuple[int, str, float]:
    """Run one benchmark, echoing its output; return its exit code, output and seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **{RESULTS_ENV: results}), cwd=REPO)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated benchmark names (core, ddp, checkpoint...); default: all")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    args = parser.parse_args()
    paths = sorted(glob.glob(os.path.join(HERE, "bench_*.py")))
    if args.only:
        wanted = {f"bench_{name.strip()}.py" for name in args.only.split(",")}
        paths = [p for p in paths if os.path.basename(p) in wanted]
    info = machine()
    sections, failed = [], []
    for path in paths:
        name = os.path.basename(path)
        print(f"\n=== {name} ===", flush=True)
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as results:
            code, output, seconds = run(path, results.name)
            tables = [json.loads(line)["markdown"] for line in results if line.strip()]
        title = f"## `benchmarks/{name}` ({seconds / 60:.1f} min)"
        if code != 0:
            failed.append(name)
            sections.append(f"{title}\n\nFAILED (exit code {code}); its last output:\n\n```\n{output[-3000:]}```\n")
        elif tables:
            sections.append(title + "\n\n" + "\n".join(tables))
        else:
            sections.append(f"{title}\n\n```\n{output.strip()}\n```\n")
    lines = [HEADER, "## Machine", ""]
    lines += [f"- {key}: {value}" for key, value in info.items()]
    lines.append("")
    document = "\n".join(lines) + "\n" + "\n".join(sections)
    with open(args.out, "w") as out:
        out.write(document)
    print(f"\nwrote {os.path.relpath(args.out, REPO)}")
    if failed:
        print(f"benchmarks that failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
