"""The GPU check's comparison script, dry-run on the CPU (benchmarks/gpu/gpu_smoke.py --device cpu).

Every case runs three ways (raw PyTorch, the engine used directly, torchbay); on the CPU the
numbers are the same kernels, so each engine driven by torchbay must give its direct use's losses
exactly: torchao FP8 (emulated, eager and compiled) against convert_to_float8_training, FSDP2
against fully_shard, DeepSpeed ZeRO-2 against deepspeed.initialize with the config torchbay built.
A GPU run then only confirms, and adds the times.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_each_engine_through_torchbay_equals_itself_used_directly_on_cpu():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/gpu/gpu_smoke.py"), "--device", "cpu",
                           "--width", "64", "--batch", "16", "--depth", "3", "--steps", "3", "--warmup", "1",
                           "--fp8-sizes", "64"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    rows = {m.group(1).strip(): m.group(0) for m in re.finditer(r"^(\w[\w ]*?) {2,}[\d.]+ .*$", out, re.M)}
    for case in ("fp32", "bf16", "bf16 compiled", "fp8 torchao", "fp8 eager", "fsdp bf16", "zero2 bf16"):
        row = rows.get(case)
        if row is None:  # an engine not installed here is named in its skipped row
            assert re.search(rf"^{case} +skipped: ", out, re.M), out
            continue
        assert row.endswith("  ok"), row
        assert " 0.00e+00  ok" in row, f"{case}: torchbay's losses differ from its reference: {row}"
    assert re.search(r"^\s+64 .* 2 Linear\(s\)$", out, re.M), out  # the FP8 table ran: 4 Linears, first and last kept
