#!/usr/bin/env bash
# Run ON THE GPU MACHINE (device tool), from the repository root, after fetch_wheels.sh here:
#   carry [".whl"], command "bash benchmarks/gpu/check.sh", timeout_s 540
# Installs torchbay and the GPU-relevant plugins into /tmp/site (no network needed), then runs,
# each step time-boxed so that one hang cannot eat the lease:
#   1. torchbay env: the device plugins' view of the machine
#   2. the cuda device conformance kit and the tests that use a real accelerator when present
#   3. gpu_smoke.py: fp32, bf16, torchao FP8, FSDP2 and DeepSpeed ZeRO-2 against raw loops
#   4. bench_fp8.py at two sizes: bf16 vs FP8 throughput
# Logs go to $OUT (they come back); the tail of the output is the summary.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed (run benchmarks/gpu/fetch_wheels.sh here and carry .whl)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
  . plugins/devices/cuda plugins/fsdp plugins/deepspeed plugins/fp8/common plugins/fp8/torchao \
  || { echo "installing torchbay failed"; exit 2; }
cd /tmp  # import the installed copies, not the source tree
repo="$OLDPWD"
status=0
step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"; shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
step env 60 python3 -m torchbay.cli.main env
step tests 200 python3 -m pytest -q -p no:cacheprovider -rs "$repo/plugins/devices/cuda/tests" \
  "$repo/tests/test_big_model_devices.py" "$repo/tests/test_fp8.py"
step smoke 120 python3 "$repo/benchmarks/gpu/gpu_smoke.py"
step fp8 120 python3 "$repo/benchmarks/bench_fp8.py" --hidden 2048,8192 --steps 10 --warmup 3
exit $status
