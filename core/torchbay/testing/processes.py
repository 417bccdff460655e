"""Run a script in N real processes through torch.distributed.run, for tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> "RunResult":
        if self.returncode != 0:
            raise AssertionError(f"exit code {self.returncode}\n--- stdout\n{self.stdout[-6000:]}\n"
                                 f"--- stderr\n{self.stderr[-8000:]}")
        return self


def run_torchrun(script: str, nprocs: int, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 timeout: float = 300, cwd: str | None = None) -> RunResult:
    """``python -m torch.distributed.run --nproc-per-node N script args`` on a free port."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("TORCHBAY_RESOLVED_CONFIG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)
    return RunResult(proc.returncode, proc.stdout, proc.stderr)


def run_python(script: str, args: Sequence[str] = (), env: dict[str, str] | None = None,
               timeout: float = 300, cwd: str | None = None) -> RunResult:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=cwd)
    return RunResult(proc.returncode, proc.stdout, proc.stderr)
