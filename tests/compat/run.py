"""Run Accelerate 1.15's own test scripts on torchbay and print a table of the results.

    python tests/compat/run.py                 # every script, 1 and 2 processes (make compat)
    python tests/compat/run.py --scripts test_ops --procs 2
    python tests/compat/run.py --accelerate    # the same cases on Accelerate itself (baseline)

Every test function of a script runs in one launch per process count (start-up is paid once),
under ``torchbay launch --num-processes N`` with the imports redirected (``redirect.py``);
then the script's whole ``main()`` runs in a launch of its own. A case that hangs (past
``worker.CASE_LIMIT_S``, when the worker writes its stacks and ends) or takes the processes
down ends the launch, and the launch is restarted with the cases after it. That case runs once
more, alone, in a fresh launch: multi-process scripts have races of their own (a queue read
by two forked workers, a gloo peer that waits for a slow fork), and a 2-core CI machine makes
them rarer but not impossible. A case that passes only on that retry is listed as flaky at
the end with the first attempt's error and stacks; one that fails again is a failure.

Exit code 1 when a case that should pass fails (see ``cases.SKIPS`` and
``cases.EXPECTED_FAILURES`` for what is not expected to pass, each with its reason).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases as _cases  # noqa: E402

WORKER = str(HERE / "worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(script: _cases.Script, procs: int, accelerate: bool, worker_args: list[str],
            whole_script: bool = False) -> tuple[list[str], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **script.env,
           "COMPAT_ON_ACCELERATE": "1" if accelerate else "0", "COMPAT_RUN_MAIN": "1" if whole_script else "0"}
    env.pop("TORCHBAY_RESOLVED_CONFIG", None)
    if not script.launched:
        env["ACCELERATE_NUM_PROCESSES"] = str(procs)
        return [sys.executable, WORKER, *worker_args], env
    if accelerate:  # as `accelerate launch --cpu` does: plain python for 1 process, torchrun for more
        env["ACCELERATE_USE_CPU"] = "true"
        if procs == 1:
            return [sys.executable, WORKER, *worker_args], env
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
                f"--master-port={free_port()}", "--master-addr=127.0.0.1", WORKER, *worker_args], env
    env.setdefault("TORCHBAY_PROCESS_GROUP_TIMEOUT_S", "120")
    torchbay = shutil.which("torchbay", path=os.path.dirname(sys.executable)) or "torchbay"
    return [torchbay, "launch", "-q", "--num-processes", str(procs), "--main-process-port", str(free_port()),
            WORKER, *worker_args], env


def read_events(out: Path) -> dict[int, list[dict]]:
    events: dict[int, list[dict]] = {}
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        events[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events


def last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*:", line) or re.match(r"^[\w.]+Error$", line):
            return line[:400]
    return (lines[-1][:400] if lines else "")


#: message of a case that passed only when run again
FLAKY = "passed on a retry"


def read_stacks(out: Path) -> str:
    """The stacks a worker wrote when its case ran past the limit (``worker.CASE_LIMIT_S``)."""
    parts = []
    for path in sorted(out.glob("rank*.stack")):
        text = path.read_text(errors="replace").strip()
        if text:
            parts.append(f"rank {path.stem[4:]}: {text}")
    return "\n".join(parts)


def retried(why: str, stacks: str, again) -> tuple[str, str]:
    """The result of a hung or crashed case (or ``main()``) that ``again()`` runs once more."""
    first = why + (f"\n{stacks}" if stacks else "")
    result, error = again()
    if result == "PASS":
        return "PASS", f"{FLAKY}; first attempt: {first}"
    return "FAIL", f"{why} (and again: {error})" + (f"\n{stacks}" if stacks else "")


def run_cases(name: str, script: _cases.Script, procs: int, names: list[str], accelerate: bool,
              timeout: float, verbose: bool, retry: bool = True) -> dict[str, tuple[str, str]]:
    """``{case: (PASS|FAIL, first error)}`` for ``names`` run in as few launches as possible."""
    results: dict[str, tuple[str, str]] = {}
    remaining = list(names)
    while remaining:
        with tempfile.TemporaryDirectory(prefix="torchbay-compat-") as tmp:
            out = Path(tmp) / "events"
            args = [name, str(out)] + remaining
            cmd, env = command(script, procs, accelerate, args)
            started = time.time()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp)
                timed_out, output = False, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                timed_out = True
                output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
            if verbose:
                print(output[-20000:], file=sys.stderr)
            events = read_events(out)
            stacks = read_stacks(out)
        per_case: dict[str, list[dict]] = {}
        started_cases: list[str] = []
        for rank_events in events.values():
            for event in rank_events:
                if event["case"] in ("<import>", "<setup>"):
                    for case in remaining:
                        results[case] = ("FAIL", f"{event['case'][1:-1]}: {event['error']}")
                    return results
                if event["event"] == "start" and event["case"] not in started_cases:
                    started_cases.append(event["case"])
                if event["event"] == "end":
                    per_case.setdefault(event["case"], []).append(event)
        ranks = procs if script.launched else 1
        finished = []
        for case in remaining:
            ends = per_case.get(case, [])
            if len(ends) == ranks:
                errors = [e["error"] for e in ends if not e["ok"]]
                results[case] = ("FAIL", errors[0]) if errors else ("PASS", "")
                finished.append(case)
        rest = [c for c in remaining if c not in finished]
        if not rest:
            break
        # the first unfinished case hung or took the processes down; blame it and go on after it
        culprit = next((c for c in rest if c in started_cases), rest[0])
        other = [e["error"] for e in per_case.get(culprit, []) if not e["ok"]]
        why = (f"timed out after {time.time() - started:.0f}s" if timed_out else
               f"processes ended during the case: {last_error_line(output)}")
        why += f"; on another rank: {other[0]}" if other else ""
        if culprit not in started_cases:  # nothing started: the launch itself failed; do not loop
            for case in rest:
                results.setdefault(case, ("FAIL", why))
            break
        results[culprit] = ("FAIL", why + (f"\n{stacks}" if stacks else ""))
        if retry:
            print(f"# {name} x{procs}: {culprit} {why[:300]}; running it again alone", file=sys.stderr)
            results[culprit] = retried(why, stacks, lambda: run_cases(
                name, script, procs, [culprit], accelerate, timeout, verbose, retry=False)[culprit])
        remaining = rest[rest.index(culprit) + 1:]
    return results


def run_main(name: str, script: _cases.Script, procs: int, accelerate: bool, timeout: float,
             verbose: bool, retry: bool = True) -> tuple[str, str]:
    """(PASS|FAIL, first error) of the script's whole ``main()``; a hang or crash is run once more."""
    with tempfile.TemporaryDirectory(prefix="torchbay-compat-") as tmp:
        out = Path(tmp) / "events"
        cmd, env = command(script, procs, accelerate, [name, str(out)], whole_script=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired:
            proc = None
        if proc is not None and verbose:
            print((proc.stdout + proc.stderr)[-20000:], file=sys.stderr)
        if proc is not None and proc.returncode == 0:
            return "PASS", ""
        recorded = [e["error"] for events in read_events(out).values() for e in events if not e.get("ok", True)]
        if recorded:  # the script did not even import: the worker wrote why; not worth a retry
            return "FAIL", f"import: {recorded[0]}"
        why = (f"timed out after {timeout:.0f}s" if proc is None else
               last_error_line(proc.stderr) or f"exit code {proc.returncode}")
        stacks = read_stacks(out)
    if not retry:
        return "FAIL", why + (f"\n{stacks}" if stacks else "")
    print(f"# {name} x{procs}: main() {why.splitlines()[0][:300]}; running it again", file=sys.stderr)
    return retried(why, stacks, lambda: run_main(name, script, procs, accelerate, timeout, verbose, retry=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="*", default=list(_cases.SCRIPTS))
    parser.add_argument("--procs", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--cases", default=None, help="only cases whose name matches this regex")
    parser.add_argument("--no-main", action="store_true", help="skip the whole-script main() runs")
    parser.add_argument("--accelerate", action="store_true", help="run on Accelerate itself (baseline)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each launch's output")
    args = parser.parse_args(argv)

    rows: list[tuple[str, str, int, str, str]] = []
    begun = time.time()
    for name in args.scripts:
        script = _cases.SCRIPTS[name]
        for procs in args.procs:
            if procs in script.procs:
                todo = []
                for case, _ in script.cases:
                    if args.cases and not re.search(args.cases, case):
                        continue
                    reason = _cases.skip_reason(name, case, procs)
                    if reason:
                        rows.append((name, case, procs, "SKIP", reason))
                    else:
                        todo.append(case)
                if todo:
                    t0 = time.time()
                    results = run_cases(name, script, procs, todo, args.accelerate, args.timeout, args.verbose)
                    print(f"# {name} x{procs}: {len(todo)} cases in {time.time() - t0:.0f}s", file=sys.stderr)
                    rows += [(name, case, procs, *results[case]) for case in todo]
            if not args.no_main and not args.cases and procs in script.main_procs:
                reason = _cases.skip_reason(name, "main()", procs)
                if reason:
                    rows.append((name, "main()", procs, "SKIP", reason))
                else:
                    t0 = time.time()
                    rows.append((name, "main()", procs,
                                 *run_main(name, script, procs, args.accelerate, args.timeout, args.verbose)))
                    print(f"# {name} x{procs}: main() in {time.time() - t0:.0f}s", file=sys.stderr)

    unexpected = print_table(rows, accelerate=args.accelerate)
    print(f"\n{'Accelerate' if args.accelerate else 'torchbay'}: {time.time() - begun:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("script", "case", "procs", "result", "error"), r))
                                               for r in rows], indent=1))
    return 1 if unexpected and not args.accelerate else 0


def print_table(rows, accelerate: bool) -> list:
    width = max([len(f"{s}::{c}") for s, c, *_ in rows] + [20])
    print(f"{'function':<{width}}  procs  result  first error / reason")
    unexpected = []
    for script, case, procs, result, error in rows:
        expected = _cases.EXPECTED_FAILURES.get((script, case, procs))
        shown = result
        if result == "FAIL" and expected:
            shown = "XFAIL"
            error = f"{expected} | {error}"
        elif result == "FAIL":
            unexpected.append((script, case, procs))
        elif result == "PASS" and expected:
            shown = "XPASS"
        first_line = error.splitlines()[0] if error else ""
        print(f"{script + '::' + case:<{width}}  {procs:>5}  {shown:<6}  {first_line[:160]}")
    for procs in sorted({r[2] for r in rows}):
        counts = {k: sum(1 for r in rows if r[2] == procs and r[3] == k) for k in ("PASS", "FAIL", "SKIP")}
        print(f"{procs} process{'es' if procs > 1 else ''}: {counts['PASS']} passed, {counts['FAIL']} failed, "
              f"{counts['SKIP']} skipped")
    # again at the end, with the stacks of a hung rank, so that the tail of a CI log names them
    flaky = [r for r in rows if r[3] == "PASS" and r[4].startswith(FLAKY)]
    if flaky:
        print(f"{len(flaky)} case(s) passed only when run again (flaky):")
        for script, case, procs, _, error in flaky:
            print(f"  {script}::{case} x{procs}: {error[:3000]}")
    if unexpected and not accelerate:
        print(f"{len(unexpected)} unexpected failure(s):")
        errors = {(s, c, p): e for s, c, p, _, e in rows}
        for key in unexpected:
            script, case, procs = key
            print(f"  {script}::{case} x{procs}: {errors[key][:3000]}")
    return unexpected


if __name__ == "__main__":
    sys.exit(main())
