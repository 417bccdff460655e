"""Launcher overhead: a no-op script in 2 processes, ``torchbay launch`` vs ``torchrun``, side by side.

Runs are interleaved (torchrun, torchbay, torchrun, ...) so that a change in machine load
hits both alike; the median wall time of each is reported with the ratio. Target: torchbay
within 5% of torchrun.

    python benchmarks/bench_launcher.py [--repeats 7] [--nproc 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _torchbay_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("torchbay")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("torchbay")
    return [found] if found else [sys.executable, "-m", "torchbay.cli.main"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall time, and CPU time of the launcher and every process it started (less load-sensitive)."""
    cpu0, start = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    elapsed, cpu = time.perf_counter() - start, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return elapsed, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--with-teardown", action="store_true",
                        help="also time torchbay launch without its fast exit (full interpreter teardown)")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="torchbay-bench-"))
    script = workdir / "noop.py"
    script.write_text("pass\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHBAY_RESOLVED_CONFIG", None)
    commands = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", str(script)],
        "torchbay launch": [*_torchbay_cmd(), "launch", "-q", f"--num-processes={args.nproc}", str(script)],
    }
    if args.with_teardown:
        # main() called from another program: the launcher does not skip the interpreter's
        # teardown at the end, as torchrun does not; shows what that shortcut is worth
        commands["torchbay, teardown"] = [sys.executable, "-c", "import sys; from torchbay.cli.main import main; "
                                          "sys.exit(main())", "launch", "-q", f"--num-processes={args.nproc}",
                                          str(script)]
    for cmd in commands.values():  # warm the page cache for both, not timed
        run_once(cmd, env)
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(args.repeats):
        order = list(commands)[i % len(commands):] + list(commands)[:i % len(commands)]
        for name in order:
            wall, cpu = run_once(commands[name], env)
            times[name].append(wall)
            cpus[name].append(cpu)
    med = {name: statistics.median(values) for name, values in times.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpus.items()}
    ratio = med["torchbay launch"] / med["torchrun"]
    ratio_cpu = med_cpu["torchbay launch"] / med_cpu["torchrun"]
    print(f"no-op script, {args.nproc} processes, {args.repeats} interleaved repetitions, medians "
          f"(load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for name in commands:
        print(f"  {name:16s} wall {med[name]:.3f} s  cpu {med_cpu[name]:.3f} s   wall runs: "
              + ", ".join(f"{v:.2f}" for v in times[name]))
    print(f"  ratio torchbay/torchrun: wall {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; target within +5%), "
          f"cpu {ratio_cpu:.3f} ({(ratio_cpu - 1) * 100:+.1f}%)")
    if "torchbay, teardown" in med:
        r = med["torchbay, teardown"] / med["torchrun"]
        rc = med_cpu["torchbay, teardown"] / med_cpu["torchrun"]
        print(f"  ratio torchbay (with teardown)/torchrun: wall {r:.3f} ({(r - 1) * 100:+.1f}%), "
              f"cpu {rc:.3f} ({(rc - 1) * 100:+.1f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"wall": times, "cpu": cpus, "median_wall": med, "median_cpu": med_cpu,
                                               "ratio_wall": ratio, "ratio_cpu": ratio_cpu}, indent=2))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
