#!/usr/bin/env bash
# Run ON THE GPU MACHINE (device tool), from the repository root, after fetch_wheels.sh here:
#   carry [".whl"], command "bash benchmarks/gpu/check.sh", timeout_s 420
# Fits 6 minutes on one H200, install included (each step is capped so that one hang cannot eat
# the lease; the caps add up to 5.5 minutes after the install):
#   1. torchbay env: the device plugins' view of the machine                          (cap 30 s)
#   2. gpu_smoke.py: each path against raw PyTorch and against its engine used directly
#      (torchao + torch.compile, fully_shard, deepspeed.initialize), then the FP8 gain at
#      hidden 2048 and 4096 (8192 is the main table's width): the table comes first   (cap 190 s)
#   3. the cuda conformance kit and the single-process tests that use a real accelerator
#      when present (big-model placement, FP8, compile)                               (cap 110 s)
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
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
step env 30 python3 -m torchbay.cli.main env
step smoke 190 python3 "$repo/benchmarks/gpu/gpu_smoke.py" --fp8-sizes 2048,4096
step tests 110 python3 -m pytest -q -p no:cacheprovider -rs -m "not multiprocess" "$repo/plugins/devices/cuda/tests" \
  "$repo/tests/big_modeling/test_big_model_devices.py" "$repo/plugins/fp8/tests/test_fp8.py" "$repo/tests/compile/test_compile.py"
exit $status
