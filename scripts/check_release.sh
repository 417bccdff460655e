#!/usr/bin/env bash
# Releases as users get them (issue 29), checked end to end; `make release-check` runs it, .ci/run once.
#
#  1. builds a wheel and an sdist of EVERY distribution (the root's torchbay and each plugins/**/setup.cfg) from a
#     clean copy of the work tree (tracked and untracked-not-ignored files: no stale build/ or *.egg-info can leak
#     into a wheel), with `python -m build --no-isolation` in the build venv (PY, default .venv);
#  2. rebuilds a wheel from each sdist (`pip wheel SDIST`) and requires the same file list as the wheel built from
#     the tree: an sdist that lacks a file (MANIFEST.in, package_data) fails here;
#  3. requires every file of each distribution's packages (modules and data: templates, resources/*.yaml,
#     accelerate.yaml...) in its wheel, and torchbay_as_accelerate.pth at the root of the core wheel;
#  4. makes a fresh venv OUTSIDE the checkout, installs the CPU torch from constraints.txt, then
#     `torchbay torchbay-fsdp torchbay-tensorboard` BY NAME from the built wheels alone
#     (`--no-index --find-links DIST --no-deps`: no index can hand out a torchbay package), then their
#     third-party dependencies (tensorboard, pluggy...) from the package index with the same names
#     (already installed, so pip keeps the wheels and only adds what is missing: checked by comparing the
#     RECORD files before and after); `pip check` must be clean;
#  5. in that venv, from a temp folder (the checkout not importable, PYTHONPATH unset): the package data is where
#     torchbay reads it (py.typed, templates through `torchbay new-plugin`, the YAML resources, the .pth switch through
#     TORCHBAY_AS_ACCELERATE=1 `import accelerate`), the plugins are loaded, and examples/char_gpt.py (tiny
#     settings) trains with `torchbay launch --num-processes 2 --strategy fsdp` logging to TensorBoard; a
#     TensorBoard event file, the jsonl metrics and the sharded saved state must exist, and a second launch resumes
#     from that state for one more epoch.
#
# Everything lives under one mktemp folder, removed at exit (KEEP=1 keeps it and prints where).
# Environment: PY (build interpreter, needs setuptools>=64, wheel, build: requirements-dev.txt), NPROC (2).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
START=$SECONDS

say() { printf '[release-check %4ss] %s\n' "$((SECONDS - START))" "$*"; }
die() { printf '[release-check] FAILED: %s\n' "$*" >&2; exit 1; }

[ -x "$PY" ] || die "no build interpreter at $PY (run 'make setup', or set PY=/path/to/python with setuptools>=64, wheel, build)"
"$PY" -c "import build, setuptools, wheel" 2>/dev/null \
    || die "$PY lacks the build tools: $PY -m pip install -c constraints.txt -r requirements-dev.txt (build, setuptools, wheel)"
git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1 || die "$ROOT is not a git checkout (the copy to build from is its file list)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/torchbay-release.XXXXXX")"
case "$WORK/" in "$ROOT"/*) die "temp folder $WORK is inside the checkout; set TMPDIR elsewhere" ;; esac
cleanup() {
    if [ "${KEEP:-0}" = 1 ]; then echo "[release-check] kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
SRC="$WORK/src" DIST="$WORK/dist" RESDIST="$WORK/from-sdist" LOGS="$WORK/logs" VENV="$WORK/venv" RUN="$WORK/run"
mkdir -p "$SRC" "$DIST" "$RESDIST" "$LOGS" "$RUN"

# run CMD with its output in a log; on failure show the log's tail and stop
logged() {
    local log="$LOGS/$1"; shift
    if ! "$@" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        die "'$*' exited non-zero (above: the end of its output)"
    fi
}

# 1. a clean copy of the work tree, and every distribution built from it
"$PY" - "$ROOT" "$SRC" <<'EOF'
import os, shutil, subprocess, sys
root, dst = sys.argv[1:]
listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        check=True, capture_output=True).stdout.decode().split("\0")
for rel in filter(None, listed):
    src = os.path.join(root, rel)
    if os.path.isfile(src) and not os.path.islink(src):  # a deleted file is still listed by --cached
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))
EOF
DIRS=(.)
for cfg in "$SRC"/plugins/*/setup.cfg "$SRC"/plugins/*/*/setup.cfg; do
    [ -f "$cfg" ] && DIRS+=("$(dirname "${cfg#"$SRC"/}")")
done
say "building a wheel and an sdist of ${#DIRS[@]} distributions"
logname() { if [ "$1" = . ]; then echo torchbay-root; else echo "${1//\//_}"; fi; }
for d in "${DIRS[@]}"; do
    out="$WORK/built/$d"
    mkdir -p "$out"
    logged "build-$(logname "$d").log" "$PY" -m build --no-isolation --sdist --wheel --outdir "$out" "$SRC/$d"
    wheels=("$out"/*.whl) sdists=("$out"/*.tar.gz)
    [ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || die "$d: expected one wheel in $out, found: $(ls "$out")"
    [ ${#sdists[@]} = 1 ] && [ -f "${sdists[0]}" ] || die "$d: expected one sdist in $out, found: $(ls "$out")"
    cp "${wheels[0]}" "${sdists[0]}" "$DIST/"
done

# 2. each sdist builds a wheel with the same files as the tree's wheel
say "rebuilding a wheel from each sdist"
for d in "${DIRS[@]}"; do
    sdist=("$WORK/built/$d"/*.tar.gz)
    out="$RESDIST/$d"
    logged "wheel-from-sdist-$(logname "$d").log" "$PY" -m pip wheel --no-deps --no-build-isolation --no-index -w "$out" "${sdist[0]}"
done

# 3. the wheels' contents
"$PY" - "$SRC" "$WORK/built" "$RESDIST" "${DIRS[@]}" <<'EOF'
import glob, os, sys, zipfile
src, built, resdist, dirs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
problems = []

def names(whl):
    with zipfile.ZipFile(whl) as z:
        return {n for n in z.namelist() if not n.endswith("/")}

for d in dirs:
    (whl,), (rewhl,) = glob.glob(os.path.join(built, d, "*.whl")), glob.glob(os.path.join(resdist, d, "*.whl"))
    ours, again = names(whl), names(rewhl)
    label = os.path.basename(whl)
    if ours != again:
        problems.append(f"{label}: the wheel built from the sdist differs from the tree's: only in the tree's "
                        f"{sorted(ours - again)}, only in the sdist's {sorted(again - ours)} (MANIFEST.in / package_data)")
    base = os.path.join(src, "core") if d == "." else os.path.join(src, d)
    packages = sorted(p for p in os.listdir(base) if os.path.isfile(os.path.join(base, p, "__init__.py"))
                      and p.startswith("torchbay"))
    if not packages:
        problems.append(f"{d}: no torchbay package found under {base}")
    for package in packages:
        for folder, subdirs, files in os.walk(os.path.join(base, package)):
            subdirs[:] = [s for s in subdirs if s != "__pycache__"]
            for f in files:
                rel = os.path.relpath(os.path.join(folder, f), base).replace(os.sep, "/")
                if not f.endswith(".pyc") and rel not in ours:
                    problems.append(f"{label} lacks {rel} (a module or package data: see setup.cfg [options.package_data])")
    if d == "." and "torchbay_as_accelerate.pth" not in ours:
        problems.append(f"{label} lacks torchbay_as_accelerate.pth at its root (setup.py BuildPyWithPth)")
if problems:
    sys.exit("[release-check] FAILED:\n  " + "\n  ".join(problems))
print(f"[release-check] {len(dirs)} wheels hold every file of their packages; each sdist rebuilds the same wheel")
EOF

# 4. a fresh venv outside the checkout: CPU torch, the three torchbay wheels by name from DIST only, then their deps
say "installing torchbay torchbay-fsdp torchbay-tensorboard into a fresh venv at $VENV"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV || true
logged venv-torch.log "$VPY" -m pip install -c "$ROOT/constraints.txt" torch==2.13.0
logged venv-wheels.log "$VPY" -m pip install --no-index --find-links "$DIST" --no-deps \
    torchbay torchbay-fsdp torchbay-tensorboard
record() {
    "$VPY" -c 'import hashlib, importlib.metadata as md, sys
for n in sys.argv[1:]: print(n, md.version(n), hashlib.sha256(md.distribution(n).read_text("RECORD").encode()).hexdigest())' \
        torchbay torchbay-fsdp torchbay-tensorboard
}
before="$(record)"
logged venv-deps.log "$VPY" -m pip install -c "$ROOT/constraints.txt" torchbay torchbay-fsdp torchbay-tensorboard
[ "$(record)" = "$before" ] || die "installing the dependencies replaced a torchbay distribution from the wheels:
$before
now:
$(record)"
"$VPY" -m pip check >"$LOGS/pip-check.log" 2>&1 || { cat "$LOGS/pip-check.log" >&2; die "pip check in the fresh venv"; }
grep -q '^torch==2.13.0' <("$VPY" -m pip freeze) || die "the fresh venv's torch is not 2.13.0 (constraints.txt)"
say "pip check clean; $(echo "$before" | cut -d' ' -f1,2 | tr '\n' ' ')"

# 5. as a user: from a temp folder, only the venv's torchbay importable
cd "$RUN"
"$VPY" - "$VENV" <<'EOF' || die "package data check in the fresh venv"
import importlib.resources as res, os, subprocess, sys, sysconfig
venv = os.path.realpath(sys.argv[1])
import torchbay, torchbay_fsdp, torchbay_tensorboard
for m in (torchbay, torchbay_fsdp, torchbay_tensorboard):
    assert os.path.realpath(m.__file__).startswith(venv + os.sep), f"{m.__name__} imported from {m.__file__}, not the venv"
tb = res.files("torchbay")
wanted = [tb / "py.typed", tb / "templates" / "device" / "setup.cfg.tmpl", tb / "resources" / "accelerate.yaml",
          tb / "resources" / "accelerate_api.yaml", tb / "resources" / "published_plugins.yaml",
          tb / "compat" / "resources" / "library_names.yaml", res.files("torchbay_fsdp") / "accelerate.yaml"]
missing = [str(p) for p in wanted if not p.is_file()]
pth = os.path.join(sysconfig.get_paths()["purelib"], "torchbay_as_accelerate.pth")
if not os.path.isfile(pth):
    missing.append(pth)
assert not missing, f"package data missing from the installed wheels: {missing}"
out = subprocess.run([sys.executable, "-c", "import accelerate; print(accelerate.Accelerator.__module__)"],
                     env={**os.environ, "TORCHBAY_AS_ACCELERATE": "1"}, capture_output=True, text=True)
assert out.returncode == 0 and out.stdout.strip().startswith("torchbay"), f"the .pth switch: {out.stdout}{out.stderr}"
print("[release-check] package data: py.typed, templates, resources/*.yaml, compat resources, accelerate.yaml, "
      "the .pth switch")
EOF
logged new-plugin.log "$VENV/bin/torchbay" new-plugin --kind device acme --output "$RUN/newplugin"
[ -f "$RUN/newplugin/acme/setup.cfg" ] || die "torchbay new-plugin wrote no setup.cfg (templates missing?)"
"$VENV/bin/torchbay" plugins --format json >"$LOGS/plugins.json" || die "torchbay plugins in the fresh venv"
"$VPY" - "$LOGS/plugins.json" <<'EOF' || die "plugins in the fresh venv"
import json, sys
by_name = {p["name"]: p for p in json.load(open(sys.argv[1]))}
for name, dist in (("fsdp", "torchbay-fsdp"), ("tensorboard", "torchbay-tensorboard")):
    p = by_name.get(name)
    assert p and p["status"] == "loaded" and p["distribution"] == dist, f"plugin {name}: {p}"
EOF

say "training with $NPROC processes (fsdp, tensorboard) from $RUN"
cp "$ROOT/examples/char_gpt.py" "$RUN/train.py"
# a collective that waits 2 minutes has hung (ranks disagree): fail then, not after torch's 30 minutes
LAUNCH=("$VENV/bin/torchbay" launch --num-processes "$NPROC" --strategy fsdp --process-group-timeout-s 120 train.py
        --output-dir out --train-windows 64 --batch-size 8 --text-bytes 60000 --log-with jsonl,tensorboard)
logged train.log "${LAUNCH[@]}" --epochs 1
grep -q "$NPROC process(es) on .*strategy FSDP" "$LOGS/train.log" \
    || { tail -n 20 "$LOGS/train.log" >&2; die "the training log does not say $NPROC processes with strategy FSDP"; }
ls out/logs/tensorboard/char_gpt/events.out.tfevents.* >/dev/null 2>&1 \
    || die "no TensorBoard event file under $RUN/out/logs/tensorboard/char_gpt: $(find out -maxdepth 4 | head -20)"
[ -s out/logs/jsonl/char_gpt/metrics.jsonl ] || die "no jsonl metrics under $RUN/out/logs/jsonl/char_gpt"
[ -f out/state/fsdp_model_0/.metadata ] || die "no sharded FSDP model state under $RUN/out/state: $(ls out/state 2>&1)"
say "resuming from the saved state for a second epoch"
logged resume.log "${LAUNCH[@]}" --epochs 2 --resume
grep -q "continuing at epoch 2 of 2" "$LOGS/resume.log" \
    || { tail -n 20 "$LOGS/resume.log" >&2; die "the resumed run did not continue at epoch 2"; }
say "OK: ${#DIRS[@]} distributions built (wheel + sdist, sdists rebuild the same wheels); fresh venv installs" \
    "torchbay torchbay-fsdp torchbay-tensorboard from them, pip check clean, package data in place, trained" \
    "with $NPROC processes (fsdp) to a TensorBoard event file and a saved state, resumed from it"
