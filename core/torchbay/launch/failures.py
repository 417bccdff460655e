"""What the launcher prints when a job fails: which rank caused it, and where every rank was.

The workers of ``torchbay launch`` (:mod:`torchbay.launch.worker`) leave, in the launcher's run
directory, per rank and attempt: ``rank<R>.a<N>.pid``, ``.stack`` (every thread's Python stack,
written by faulthandler when a failing rank asks before it leaves) and ``.exit`` (exit code and
time). torch elastic's error file of a failed rank carries its traceback, the failure time in
nanoseconds and whether the error looks like a consequence of another rank's failure (a broken
or timed-out collective).

The cause is chosen in this order: a rank's own error (earliest first); a rank that left
(exit code 0 or not) while the others still ran; a rank killed by a signal; a rank stopped by
the launcher that was *not* inside a collective while the others waited in one (it never
reached it). Consequences (connection reset, collective timed out) come last, and their
tracebacks are folded under the summary. When every rank failed as a consequence or was stopped
while waiting in a collective, and the ranks wait in collectives of different kinds (rank 0 in
``all_reduce``, rank 1 in ``all_gather``), the summary says so first, naming each with its call site.
"""

from __future__ import annotations

import datetime
import glob
import os
import re
import signal
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Mapping

from torchbay.launch.flight_recorder import describe_dumps

_FRAME_TB = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>.*)$')
_FRAME_FH = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
_STDLIB = sysconfig.get_paths().get("stdlib", "/nonexistent-stdlib")
WORKER_FILE = os.path.join("torchbay", "launch", "worker.py")  # the launched program (launch/worker.py)


def _internal(path: str) -> bool:
    return (path.startswith("<") or path.startswith(_STDLIB) or WORKER_FILE in path
            or any(part in path for part in ("/torch/", "/torchbay/", "/torchbay_")))


def _in_collective(frames: list[tuple[str, int, str]]) -> str | None:
    """The collective a stack is waiting in (``torch.distributed.barrier``...), or ``None``.

    Collectives torch runs from C++ count too: DDP's gradient all-reduce inside ``backward``
    and its buffer broadcast in ``forward``. A strategy's own collectives (``Strategy.barrier``...)
    wait on their work in ``ProcessCollectives.wait`` (distributed/collectives.py): named by the collective that
    called it.
    """
    calls = [func for path, _, func in frames if "/torch/distributed/" in path and func not in ("wrapper", "<lambda>")]
    if calls:
        return f"torch.distributed.{calls[-1]}"  # the outermost torch.distributed function
    for (path, _, func), caller in zip(frames, frames[1:]):
        if func == "wait" and path.endswith("/torchbay/distributed/collectives.py"):
            return f"torch.distributed.{caller[2]}"
    for path, _, func in frames:
        if "/torch/nn/parallel/distributed.py" in path:
            return f"DistributedDataParallel.{func} (its buffer broadcast or gradient all-reduce)"
        if "/torch/autograd/" in path and func in ("backward", "_engine_run_backward", "grad"):
            return "backward (DDP's gradient all-reduce runs in it)"
    return None


def _where(frames: list[tuple[str, int, str]]) -> str:
    """``file.py:12 in func`` of the innermost frame of the user's own code."""
    for path, line, func in frames:
        if not _internal(path):
            return f"{os.path.basename(path)}:{line} in {func}"
    return "(no frame of the script)"


def parse_stack_dump(text: str) -> list[tuple[str, int, str]]:
    """The main thread's frames (innermost first) from a faulthandler dump."""
    blocks: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            blocks.append([])
        match = _FRAME_FH.match(line)
        if match and blocks:
            blocks[-1].append((match["file"], int(match["line"]), match["func"]))
    main = [b for b in blocks if any(WORKER_FILE in path for path, _, _ in b)]
    return (main or blocks or [[]])[-1]


def parse_traceback(text: str) -> list[tuple[str, int, str]]:
    """The frames of a Python traceback, innermost first."""
    frames = [(m["file"], int(m["line"]), m["func"]) for m in map(_FRAME_TB.match, text.splitlines()) if m]
    return frames[::-1]


@dataclass
class RankStory:
    rank: int
    failure: Any = None  # torch elastic ProcessFailure
    exit: tuple[int, int] | None = None  # (exit code, time ns) from the rank's exit record
    stack: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def extra(self) -> dict:
        data = (self.failure.error_file_data or {}) if self.failure is not None else {}
        message = data.get("message") if isinstance(data, dict) else None
        return (message.get("extraInfo") or {}) if isinstance(message, dict) else {}

    @property
    def message(self) -> str:
        data = (self.failure.error_file_data or {}) if self.failure is not None else {}
        message = data.get("message") if isinstance(data, dict) else None
        return str(message.get("message") or "") if isinstance(message, dict) else ""

    @property
    def time_ns(self) -> int:
        return int(self.extra.get("torchbay_time_ns", 0) or 0)

    @property
    def consequence(self) -> bool:
        return self.extra.get("torchbay_consequence") == "1"

    @property
    def stopped(self) -> bool:
        return self.failure is not None and self.failure.exitcode == -int(signal.SIGTERM) and not self.time_ns

    def kind(self) -> int:
        """0 own error, 1 left early, 2 killed, 3 never reached the collective, 4 consequence, 5 stopped."""
        if self.exit is not None and (self.failure is None or self.stopped):
            return 1  # its script had ended (the launcher may have cut short only the interpreter's exit)
        if self.time_ns:
            return 4 if self.consequence else 0
        if self.stopped:
            return 3 if self.stack and not _in_collective(self.stack) else 5
        return 2

    def sort_time(self) -> int:
        if self.exit is not None and (self.failure is None or self.stopped):
            return self.exit[1]
        return self.time_ns or int(self.failure.timestamp * 10**9)


def read_run_dir(run_dir: str | None) -> tuple[dict[int, tuple[int, int]], dict[int, str]]:
    """Exit records and stack dumps of the latest attempt, by rank."""
    if not run_dir or not os.path.isdir(run_dir):
        return {}, {}
    names = [os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "rank*.a*.*"))]
    attempts = [int(m[1]) for m in (re.match(r"rank\d+\.a(\d+)\.", n) for n in names) if m]
    if not attempts:
        return {}, {}
    attempt = max(attempts)
    exits, stacks = {}, {}
    for name in names:
        match = re.match(rf"rank(\d+)\.a{attempt}\.(exit|stack)$", name)
        if not match:
            continue
        try:
            text = open(os.path.join(run_dir, name), errors="replace").read()
        except OSError:
            continue
        if match[2] == "exit" and len(text.split()) == 2:
            code, when = text.split()
            exits[int(match[1])] = (int(code), int(when))
        elif match[2] == "stack" and text.strip():
            stacks[int(match[1])] = text
    return exits, stacks


def clean_traceback(text: str) -> str:
    """Drop the launcher's own frames (the worker, runpy) from a worker's traceback."""
    out, skip = [], False
    for line in text.rstrip().splitlines():
        if line.startswith('  File "'):
            skip = WORKER_FILE in line or "<frozen runpy>" in line or "/runpy.py" in line
        elif not line.startswith("    "):
            skip = False
        if not skip:
            out.append(line)
    return "\n".join(out)


def _at(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9).strftime("%H:%M:%S.%f")[:-3]


def _exitcode(failure) -> int:
    """The rank's exit code. A rank that recorded its own failure and was then stopped by the
    launcher while still leaving (its peers died of it first) keeps the code it was leaving with."""
    recorded = RankStory(-1, failure=failure).extra.get("torchbay_exit_code")
    if failure.exitcode == -int(signal.SIGTERM) and str(recorded or "").lstrip("-").isdigit():
        return int(recorded)
    return failure.exitcode


def how(failure) -> str:
    code = _exitcode(failure)
    if code < 0:
        return f"killed by signal {failure.signal_name()}"
    data = failure.error_file_data or {}
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict) and message.get("message"):
        text = str(message["message"]).splitlines()[0]
        return f"exit code {code}: {text[:300]}"
    return f"exit code {code}"


def exit_code(failure) -> int:
    code = _exitcode(failure)
    if code < 0:
        return 128 + (-code)
    return code or 1


def _note(story: RankStory) -> str:
    if story.consequence:
        return ", a consequence of the first failure"
    if story.failure is not None and _exitcode(story.failure) == -int(signal.SIGTERM):
        return ", stopped by the launcher"
    return ""


def _position(story: RankStory) -> tuple[str | None, str]:
    """(the collective the rank was in or ``None``, ``file.py:12 in func``) when it failed or was stopped."""
    # a rank that failed on its own is described by its traceback (a stack dump taken while it was
    # already failing shows only the failure handling); a rank stopped by the launcher by its stack
    callstack = parse_traceback(str(story.extra.get("py_callstack", "")))
    frames = (callstack if story.time_ns and callstack else story.stack) or callstack
    return _in_collective(frames), (_where(frames) if frames else "unknown (no stack)")


def _different_collectives(stories: list[RankStory]) -> str | None:
    """``rank 0 in X called at a.py:3 in f; rank 1 in Y called at ...`` when the ranks wait in
    collectives of different kinds (each waits for the others in a collective they never enter)."""
    places: dict[tuple[str, str], list[int]] = {}
    for story in sorted(stories, key=lambda s: s.rank):
        call, place = _position(story)
        if call is not None:
            places.setdefault((call, place), []).append(story.rank)
    if len({call for call, _ in places}) < 2:
        return None
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} in {call} called at {place}"
                     for (call, place), ranks in places.items())


def _describe_rank(story: RankStory) -> str:
    if story.kind() == 1:
        code, when = story.exit
        return f"exited with code {code} at {_at(when)} while other ranks still ran"
    call, place = _position(story)
    state = f"in {call} called at {place}" if call else f"at {place}, not in a collective"
    if story.stopped:
        return f"{state} (stopped by the launcher)"
    what = how(story.failure)
    return f"{state} ({what[:110] + '...' if len(what) > 110 else what}{_note(story)})"


def describe_stacks(run_dir: str | None) -> list[str]:
    """``rank R: <where>`` for every rank that wrote a stack dump (the job stopped by a signal)."""
    _, stacks = read_run_dir(run_dir)
    lines = []
    for rank in sorted(stacks):
        frames = parse_stack_dump(stacks[rank])
        call = _in_collective(frames)
        lines.append(f"  rank {rank}: " + (f"in {call} called at {_where(frames)}" if call
                                           else f"at {_where(frames)}, not in a collective"))
    return lines


def describe_failures(failures: Mapping[int, Any], plan, run_dir: str | None = None) -> tuple[str, int]:
    """The report printed when ranks failed, naming the cause first; and the exit code to return."""
    exits, stacks = read_run_dir(run_dir)
    stories = {rank: RankStory(rank, failure=f) for rank, f in failures.items()}
    for rank, text in stacks.items():
        stories.setdefault(rank, RankStory(rank)).stack = parse_stack_dump(text)
    first_failure = min((s.sort_time() for s in stories.values() if s.failure is not None), default=0)
    for rank, (code, when) in exits.items():
        story = stories.get(rank)
        if story is None and (not first_failure or when <= first_failure):
            stories[rank] = RankStory(rank, exit=(code, when))
        elif story is not None and story.stopped:
            story.exit = (code, when)
    stories = {r: s for r, s in stories.items() if s.failure is not None or s.exit is not None}
    ordered = sorted(stories.values(), key=lambda s: (s.kind(), s.sort_time(), s.rank))
    cause = ordered[0]
    kind = cause.kind()
    failed = [s for s in ordered if s.failure is not None and s.kind() in (0, 2, 4)] or \
        [s for s in ordered if s.failure is not None]
    code = exit_code((cause if kind in (0, 2) else failed[0]).failure)
    machine = f" on machine {plan.machine_rank}" if plan.num_machines > 1 else ""
    # nobody failed on its own, left or never reached a collective: are they in different ones?
    mismatch = _different_collectives([s for s in ordered if s.failure is not None]) if kind in (4, 5) else None
    lines = []
    if mismatch:
        lines.append(f"torchbay launch: the ranks are in different collectives{machine}: {mismatch}; every rank must "
                     f"enter the same collectives in the same order, so each waited for the others until it failed "
                     f"or was stopped")
    elif kind == 1:
        lines.append(f"torchbay launch: rank {cause.rank} left first: it exited with code {cause.exit[0]} at "
                     f"{_at(cause.exit[1])}{machine} while the other ranks were still running; every rank must reach "
                     f"the same collectives, so the others failed waiting for it")
    elif kind == 3:
        lines.append(f"torchbay launch: rank {cause.rank} never reached the collective the other ranks waited in: "
                     f"it was at {_where(cause.stack)} (local rank {cause.failure.local_rank}{machine}, pid "
                     f"{cause.failure.pid}); the others timed out or failed waiting for it")
    else:
        when = _at(cause.time_ns) if cause.time_ns else datetime.datetime.fromtimestamp(
            cause.failure.timestamp).strftime("%H:%M:%S")
        lines.append(f"torchbay launch: rank {cause.rank} failed first ({how(cause.failure)}; local rank "
                     f"{cause.failure.local_rank}{machine}, pid {cause.failure.pid}, at {when})")
        callstack = str(cause.extra.get("py_callstack", ""))
        if callstack:
            lines.append(clean_traceback(callstack))
        elif cause.message:
            lines.append(cause.message)
    after_cause = ordered if mismatch else ordered[1:]  # a mismatch has no first failure: every rank follows
    others = [f"rank {s.rank} ({how(s.failure)}{'' if mismatch else _note(s)})" for s in after_cause
              if s.failure is not None]
    if others:
        lines.append(("how each rank ended: " if mismatch else "then: ") + "; ".join(others))
    if stacks or kind == 1:
        lines.append("where each rank was:")
        lines += [f"  rank {s.rank}: {_describe_rank(s)}" for s in sorted(stories.values(), key=lambda s: s.rank)]
    folded = [s for s in after_cause if s.failure is not None and s.extra.get("py_callstack")]
    if folded:
        lines.append("tracebacks (folded):" if mismatch else "secondary tracebacks (what the other ranks saw; folded):")
        for s in folded:
            lines.append(f"  rank {s.rank}:")
            lines += ["  | " + line for line in clean_traceback(str(s.extra["py_callstack"])).splitlines()]
    lines += describe_dumps(run_dir)  # the collective flight recorder's dumps, where a device plugin turned it on
    lines.append(f"every process of the job was stopped; exit code {code}")
    return "\n".join(lines), code
