"""Accelerate 1.15.0's own test suite, each file on Accelerate and on torchbay (the switch), side by side.

    python tests/compat_suite/run.py                      # every file, both sides (make compat-suite)
    python tests/compat_suite/run.py --files test_utils test_data_loader
    python tests/compat_suite/run.py --side torchbay      # only torchbay's side (Accelerate's from --baseline)

The tests are Accelerate's, never copied here: the accelerate 1.15.0 source archive is fetched with pip at run
time (cached under ``.cache/accelerate-sdist``), and the folders the archive lacks (test configs, samples,
examples) are read from ``../shared/accelerate-1.15-extras`` (or ``$TORCHBAY_ACCELERATE_EXTRAS``). Both are laid
side by side in a temporary folder, the archive's files winning, and each test file runs there twice with pytest:
once on the installed Accelerate and once with ``TORCHBAY_AS_ACCELERATE=1``.

The table (per file: passed/failed/skipped on each side, and each test lost with its first error line) is
written to ``docs/accelerate-suite.md``. Tests that pass on Accelerate and are lost on torchbay on purpose are
listed in ``refusals.yaml`` beside this file, each with what a user loses, why, and the alternative; the differences
still to fix are in ``known_losses.txt``. Exit code 1 when a test that passes on Accelerate fails on torchbay and is
in neither list (a new difference) and fails again when run alone (some of Accelerate's tests compare unseeded random
weights with a margin and fail on a rare draw; the retried ones are printed); the share kept is printed beside
:data:`TARGET`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VERSION = "1.15.0"
TARGET = 0.95
CACHE = REPO / ".cache" / "accelerate-sdist"
DOC = REPO / "docs" / "accelerate-suite.md"
#: seconds one test file may run on one side before it counts as failed (the slowest takes about 3 minutes)
FILE_LIMIT_S = 900


def extras_dir() -> Path | None:
    given = os.environ.get("TORCHBAY_ACCELERATE_EXTRAS")
    for candidate in ([Path(given)] if given else []) + [REPO.parent / "shared" / "accelerate-1.15-extras"]:
        if (candidate / "tests").is_dir():
            return candidate
    return None


def fetch_sdist() -> Path:
    """The accelerate sdist's unpacked folder, fetched with pip once and kept in :data:`CACHE`."""
    unpacked = CACHE / f"accelerate-{VERSION}"
    if (unpacked / "tests").is_dir():
        return unpacked
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"accelerate=={VERSION}", "-d", str(CACHE)], check=True)
    archive = CACHE / f"accelerate-{VERSION}.tar.gz"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"accelerate-{VERSION}/tests/")]
        tar.extractall(CACHE, members=members, filter="data")
    return unpacked


def workspace(root: Path) -> Path:
    """``root`` with ``tests/`` (extras, then the sdist's files over them) and ``examples/``."""
    extras = extras_dir()
    if extras is None:
        print("# ../shared/accelerate-1.15-extras not found (set TORCHBAY_ACCELERATE_EXTRAS): the tests that read "
              "test configs, samples or examples fail on both sides", file=sys.stderr)
    else:
        shutil.copytree(extras / "tests", root / "tests")
        shutil.copytree(extras / "examples", root / "examples")
    shutil.copytree(fetch_sdist() / "tests", root / "tests", dirs_exist_ok=True)
    return root


def test_files(root: Path) -> list[str]:
    tests = root / "tests"
    return sorted(str(p.relative_to(tests)) for p in tests.rglob("test_*.py"))


def run_file(root: Path, file: str, side: str, out: Path) -> tuple[str, str, float]:
    """Run one file on one side; the junit XML lands in ``out``."""
    report = out / side / (file.replace("/", "__") + ".xml")
    report.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHBAY_RESOLVED_CONFIG", None)
    env["TORCHBAY_AS_ACCELERATE"] = "1" if side == "torchbay" else "0"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
           f"--junitxml={report}", f"tests/{file}"]
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=FILE_LIMIT_S)
        tail = (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        tail = f"timed out after {FILE_LIMIT_S}s\n" + ((exc.stdout or b"")[-3000:]).decode(errors="replace")
    return file, tail, time.time() - started


def first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    for line in lines:
        if line.startswith("E ") and len(line) > 2:
            return line[1:].strip()[:300]
    return (lines[-1] if lines else "")[:300]


def read_report(path: Path, crash: str) -> dict[str, tuple[str, str]]:
    """``{test id: (passed|failed|skipped, first error line)}``; a file that did not run is one failed entry."""
    if not path.exists():
        return {"<file>": ("failed", first_line(crash) or "no report")}
    results: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}".lstrip(":")
        outcome, error = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                error = first_line((child.text or "") + "\n" + (child.get("message") or ""))
                break
            if child.tag == "skipped":
                outcome, error = "skipped", (child.get("message") or "")[:300]
        results[name] = (outcome, error)
    if not results and "error" in crash.lower():
        results["<file>"] = ("failed", first_line(crash))
    return results


def refusals() -> dict[str, dict[str, str]]:
    """``{"file::test": {"loses", "why", "instead"}}`` from refusals.yaml; a key may end in ``*``."""
    path = HERE / "refusals.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


#: tests that pass on Accelerate and are still lost on torchbay, each a difference to fix (not a refusal): the run
#: fails on a loss that is in neither list, so a new difference cannot land; ``--write-known`` rewrites it
KNOWN = HERE / "known_losses.txt"


def known_lines() -> dict[str, str]:
    """``{test key: its line}``; a line is ``file::Class::test  # why it is still lost``."""
    if not KNOWN.exists():
        return {}
    lines = [line.rstrip() for line in KNOWN.read_text().splitlines()]
    return {line.split("#", 1)[0].strip(): line for line in lines if line.strip() and not line.startswith("#")}


def known_losses() -> set[str]:
    return set(known_lines())


def refusal_for(key: str, table: dict[str, dict[str, str]]) -> dict[str, str] | None:
    for pattern, entry in table.items():
        if key == pattern or (pattern.endswith("*") and key.startswith(pattern[:-1])):
            return entry
    return None


def summarise(files: list[str], results: dict[str, dict[str, dict[str, tuple[str, str]]]],
              seconds: dict[str, dict[str, float]]) -> tuple[str, int, int, list[str]]:
    """The markdown table, the counts (passing on Accelerate, of those passing on torchbay) and the unlisted losses."""
    listed, known = refusals(), known_lines()
    rows, lost_rows, unlisted = [], [], []
    total_acc = total_both = 0
    for file in files:
        acc, tb = results["accelerate"].get(file, {}), results["torchbay"].get(file, {})
        count = {side: {k: sum(1 for o, _ in r.values() if o == k) for k in ("passed", "failed", "skipped")}
                 for side, r in (("accelerate", acc), ("torchbay", tb))}
        passing = [name for name, (outcome, _) in acc.items() if outcome == "passed"]
        kept = [name for name in passing if tb.get(name, ("missing", ""))[0] == "passed"]
        total_acc += len(passing)
        total_both += len(kept)
        a, t = count["accelerate"], count["torchbay"]
        rows.append(f"| {file} | {a['passed']} / {a['failed']} / {a['skipped']} | {t['passed']} / {t['failed']} / "
                    f"{t['skipped']} | {len(kept)} of {len(passing)} | {seconds['accelerate'].get(file, 0):.0f} s / "
                    f"{seconds['torchbay'].get(file, 0):.0f} s |")
        for name in passing:
            if name in kept:
                continue
            outcome, error = tb.get(name, tb.get("<file>", ("missing", "not collected")))
            key = f"{file}::{name}"
            entry = refusal_for(key, listed)
            if entry is None:
                if key not in known:
                    unlisted.append(key)
                reason = known[key].partition("#")[2].strip() if key in known else ""
                label = ("still to fix" + (f" ({reason})" if reason else "")) if key in known else "**new**"
                why = f"{label}: {outcome}: {error}"
            else:
                why = f"refused: {entry['why']} Loses: {entry['loses']} Instead: {entry['instead']}"
            lost_rows.append(f"| `{key}` | {why.replace('|', '/')} |")
    share = total_both / total_acc if total_acc else 1.0
    text = "\n".join([
        "# Accelerate's own test suite on torchbay",
        "",
        "<!-- generated by tests/compat_suite/run.py (make compat-suite); do not edit -->",
        "",
        f"Accelerate {VERSION}'s `tests/` (the source archive from the package index, with the folders it lacks from",
        "`../shared/accelerate-1.15-extras`), each file run with pytest on Accelerate and on torchbay under",
        "`TORCHBAY_AS_ACCELERATE=1`, on a CPU machine. Of the tests that pass on Accelerate, "
        f"**{total_both} of {total_acc} ({share:.1%}) pass on torchbay**.",
        "",
        "| file | Accelerate passed / failed / skipped | torchbay passed / failed / skipped | "
        "Accelerate's passing kept | time (Accelerate / torchbay) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "## Tests that pass on Accelerate and not on torchbay",
        "",
        "Each is refused on purpose (tests/compat_suite/refusals.yaml: why, what a user loses, what to use instead)",
        "or a difference still to fix (tests/compat_suite/known_losses.txt).",
        "",
        "| test | result on torchbay |",
        "|---|---|",
        *(lost_rows or ["| (none) | |"]),
        "",
    ])
    return text, total_acc, total_both, unlisted


def retried_passes(root: Path, out: Path, unlisted: list[str]) -> list[str]:
    """Each new loss run once more on torchbay, alone: those that pass then. Some of Accelerate's tests draw unseeded
    random weights and compare them with a margin (test_save_load_model_with_hooks: a fresh random Linear must differ
    from the saved one by 1e-3), so a rare draw fails them on either side; one that fails twice stays a loss."""
    passed = []
    for key in unlisted:
        file, _, name = key.partition("::")
        if name == "<file>":
            continue
        report = out / "retry" / (key.replace("/", "__").replace("::", "--") + ".xml")
        report.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHBAY_AS_ACCELERATE": "1"}
        env.pop("TORCHBAY_RESOLVED_CONFIG", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
               f"--junitxml={report}", f"tests/{file}::{name}"]
        try:
            subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=FILE_LIMIT_S)
        except subprocess.TimeoutExpired:
            continue
        outcomes = read_report(report, "")
        if outcomes.get(name, ("missing", ""))[0] == "passed":
            passed.append(key)
    return passed


def lost_now(files: list[str], results: dict[str, dict[str, dict[str, tuple[str, str]]]]) -> set[str]:
    """Every ``file::test`` that passed on Accelerate and not on torchbay in this run."""
    lost = set()
    for file in files:
        torchbay = results["torchbay"].get(file, {})
        for name, (outcome, _) in results["accelerate"].get(file, {}).items():
            if outcome == "passed" and torchbay.get(name, ("missing", ""))[0] != "passed":
                lost.add(f"{file}::{name}")
    return lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=None, help="test files (names as in tests/, .py optional)")
    parser.add_argument("--side", choices=("both", "accelerate", "torchbay"), default="both")
    parser.add_argument("--jobs", type=int, default=2, help="files run at once")
    parser.add_argument("--keep", default=None, help="keep the workspace and reports in this folder")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/accelerate-suite.md")
    parser.add_argument("--write-known", action="store_true",
                        help="record every loss not refused as still to fix (known_losses.txt)")
    args = parser.parse_args(argv)

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="torchbay-accelerate-suite-"))
    if args.keep and root.exists():
        shutil.rmtree(root / "tests", ignore_errors=True)
        shutil.rmtree(root / "examples", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    workspace(root)
    files = test_files(root)
    if args.files:
        wanted = {f if f.endswith(".py") else f + ".py" for f in args.files}
        files = [f for f in files if f in wanted or Path(f).name in wanted]
    sides = ("accelerate", "torchbay") if args.side == "both" else (args.side,)
    out = root / "reports"
    crashes: dict[str, dict[str, str]] = {side: {} for side in ("accelerate", "torchbay")}
    seconds: dict[str, dict[str, float]] = {side: {} for side in ("accelerate", "torchbay")}
    begun = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_file, root, file, side, out): side for file in files for side in sides}
        for future in concurrent.futures.as_completed(futures):
            side = futures[future]
            file, tail, took = future.result()
            crashes[side][file], seconds[side][file] = tail, took
            print(f"# {side:10s} {file} in {took:.0f}s", file=sys.stderr, flush=True)
    results = {side: {file: read_report(out / side / (file.replace("/", "__") + ".xml"), crashes[side].get(file, ""))
                      for file in files} for side in ("accelerate", "torchbay")}
    text, total_acc, total_both, unlisted = summarise(files, results, seconds)
    if unlisted and "torchbay" in sides:
        retried = retried_passes(root, out, unlisted)
        for key in retried:
            file, _, name = key.partition("::")
            results["torchbay"][file][name] = ("passed", "")
        if retried:
            print(f"# passed when run again alone (an unseeded random draw): {', '.join(retried)}", file=sys.stderr)
            text, total_acc, total_both, unlisted = summarise(files, results, seconds)
    print(text)
    print(f"# {len(files)} files in {time.time() - begun:.0f}s; workspace {root}", file=sys.stderr)
    if args.write_known and args.side == "both" and not args.files:
        kept = known_lines()  # a line keeps the reason written after its key
        still = {key for key in kept if key in lost_now(files, results)}
        KNOWN.write_text("# Accelerate's tests that pass on Accelerate and not yet on torchbay: differences to fix, "
                         "written by\n# tests/compat_suite/run.py --write-known (a refusal belongs in refusals.yaml); "
                         "`# why` after a key says why it is still lost\n"
                         + "".join(f"{kept.get(key, key)}\n" for key in sorted(still | set(unlisted))))
        unlisted = []
    if not args.no_doc and args.side == "both" and not args.files:
        DOC.write_text(text)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if args.side != "both":
        return 0
    share = total_both / total_acc if total_acc else 1.0
    print(f"# {share:.1%} of the tests that pass on Accelerate pass on torchbay (target {TARGET:.0%})", file=sys.stderr)
    if unlisted:
        print(f"# {len(unlisted)} tests pass on Accelerate and fail on torchbay, neither refused (refusals.yaml) nor "
              "known (known_losses.txt):\n" + "\n".join(unlisted), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
