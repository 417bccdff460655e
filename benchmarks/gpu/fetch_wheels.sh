#!/usr/bin/env bash
# Run HERE (this machine, registries reachable), from anywhere: puts into <repo>/.whl the wheels
# the GPU machine lacks (it has torch, pluggy, safetensors, PyYAML, tqdm, pytest, but no network),
# and keeps .whl out of git. Then give the device tool: carry [".whl"], command
# "bash benchmarks/gpu/check.sh". About 8 MB.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
py=".venv/bin/python"
[ -x "$py" ] || py=python3
# versions as in this repository's venv; the GPU machine runs Python 3.12
want=()
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in pydantic pydantic_core annotated_types typing_inspection hjson torchao; do
  want+=("$name==$(version "$name")")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${want[@]}"
# DeepSpeed is published as a source archive: build its pure-Python wheel here (ops compile on use)
"$py" -m pip wheel -q --no-deps -w .whl "deepspeed==$(version deepspeed)"
ls -1 .whl
