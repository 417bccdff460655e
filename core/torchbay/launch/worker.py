"""The program each process started by ``torchbay launch`` runs: it runs the user's script.

torch.distributed.run starts ``python -u <this file> [-m] TARGET ARGS...``. This file is run
by path, not imported as part of the ``torchbay`` package, so a process pays for no import
beyond what the user's script itself imports (a no-op script costs what it costs under
torchrun).

When the script fails, the exception is recorded in the error file that
torch.distributed.elastic gives every worker (``TORCHELASTIC_ERROR_FILE``), in the layout
``@record`` (``ErrorHandler.record_exception``) writes. The record also carries the failure time in
nanoseconds and whether the
error looks like the consequence of another rank's death (a broken collective), so that the
launcher can name the rank that failed *first*.
"""

from __future__ import annotations

import os
import sys
import time

#: substrings of errors a rank gets when *another* rank died under a collective, or never came
CONSEQUENCE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                       "Broken pipe", "NCCL communicator was aborted", "ProcessGroup abort", "Timed out waiting",
                       "timed out waiting", "Watchdog caught collective operation timeout")
#: set by torchbay launch for the workers it starts (torchrun mode)
RUN_DIR_ENV = "TORCHBAY_RUN_DIR"
LAUNCHER_PID_ENV = "TORCHBAY_LAUNCHER_PID"
#: offset above SIGRTMIN of the signal on which a worker writes every thread's Python stack to
#: ``<run dir>/rank<R>.a<attempt>.stack``: a real-time signal, so that a script's own SIGUSR1/SIGUSR2
#: handlers (SLURM pre-emption, Lightning's requeue) are never triggered by it
STACK_SIGNAL_RT_OFFSET = 3
_PR_SET_PDEATHSIG = 1
CONSEQUENCE_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")


def is_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a rank learning that another rank died or left (not a root cause).

    The errors it was raised from count too: torchbay's "the process group did not form"
    (a rank that waited for a peer that had already exited) is raised from torch's store timeout.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = f"{type(exc).__name__}: {exc}"
        if type(exc).__name__ in CONSEQUENCE_TYPES or any(m in text for m in CONSEQUENCE_MARKERS):
            return True
        exc = exc.__cause__
    return False


def record_failure(exc: BaseException, when_ns: int, exit_code: int) -> bool:
    """Write torch elastic's error file for ``exc`` (call inside the ``except`` block).

    ``exit_code`` is the code the rank is about to leave with: the launcher may stop the rank
    with SIGTERM while it is still leaving (its peers died of its failure faster), and then
    reports this code rather than the signal. Returns whether the record was written.

    The record has the layout of ``ErrorHandler.record_exception`` (what ``@record`` writes
    and the elastic agent reads back into ``ProcessFailure``); it is written here directly so
    that a failing rank does not first spend seconds importing torch's elastic package.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    import json
    import traceback

    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": traceback.format_exc(),
                                      "timestamp": str(when_ns // 10**9),
                                      "torchbay_time_ns": str(when_ns),
                                      "torchbay_consequence": "1" if is_consequence(exc) else "0",
                                      "torchbay_exit_code": str(exit_code)}}}
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError as problem:  # never hide the user's error behind ours
        print(f"torchbay: could not record the failure in {path}: {problem}", file=sys.stderr)
        return False
    return True


def release_process_group() -> None:
    """Destroy the process group after a failure, so no exit handler waits on a barrier that
    the other ranks, stuck in a collective of their own, will never reach."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _user_frames(tb):
    """Skip this file's and runpy's frames at the top of a traceback."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ or os.path.basename(
            tb.tb_frame.f_code.co_filename) in ("<frozen runpy>", "runpy.py")):
        tb = tb.tb_next
    return tb


def run(argv: list[str]) -> None:
    import runpy

    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        # this file's folder (torchbay/cli) must not shadow the user's modules
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def stop_own_children() -> None:
    """Stop what a failed rank started: torchrun gives each worker its own process group and
    kills the groups of the workers still running, but not of one that already exited."""
    import signal

    if os.getpgrp() != os.getpid():  # not a group of our own (e.g. a task under srun): leave it
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(os.getpid(), signal.SIGTERM)
    except OSError:
        pass


def _rank_file(suffix: str, rank: str | None = None) -> str | None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    rank = rank if rank is not None else os.environ.get("RANK", "0")
    return os.path.join(run_dir, f"rank{rank}.a{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{suffix}")


def die_with_launcher() -> None:
    """Linux: end this worker, and everything it starts, when the launcher dies (even by SIGKILL).

    A parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) ends the worker itself; a
    small forked sentinel waits on the launcher's pidfd and then kills the worker's own process
    group, so the script's children go too (torchrun gives each worker a group of its own).
    """
    import signal

    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0") or 0)
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != launcher:  # it died before the signal was armed
        os._exit(128 + int(signal.SIGKILL))
    if os.getpgrp() != os.getpid() or not hasattr(os, "pidfd_open"):
        return
    try:
        launcher_fd, worker_fd = os.pidfd_open(launcher), os.pidfd_open(os.getpid())
    except OSError:
        return
    if os.fork() != 0:
        os.close(launcher_fd)
        os.close(worker_fd)
        return
    # the sentinel: no Python code of the user's runs here
    try:
        import select

        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, min(launcher_fd, worker_fd))
        os.closerange(max(launcher_fd, worker_fd) + 1, 65536)
        ready, _, _ = select.select([launcher_fd, worker_fd], [], [])
        # the worker's parent-death signal may wake us before the launcher's pidfd does
        if launcher_fd in ready or _exiting(launcher):
            run_dir = os.environ.get(RUN_DIR_ENV, "")
            if os.path.basename(run_dir).startswith("torchbay-run-"):  # the launcher's mkdtemp, which it cannot
                import shutil  # remove any more; never another directory

                shutil.rmtree(run_dir, ignore_errors=True)
            os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(0)


def stack_signal() -> int:
    import signal

    rtmin = getattr(signal, "SIGRTMIN", None)
    return int(rtmin) + STACK_SIGNAL_RT_OFFSET if rtmin is not None else int(signal.SIGUSR1)


def _exiting(pid: int) -> bool:
    """Whether process ``pid`` is gone or on its way out (PF_EXITING is set before any parent-death
    signal is sent)."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            fields = fp.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & 0x4)


def arm_stack_dump() -> None:
    """Write every thread's Python stack to the rank's stack file on :func:`stack_signal` (no debugger
    needed, works while the rank is blocked in C code), then publish this rank's pid."""
    import faulthandler

    path, pid_path = _rank_file("stack"), _rank_file("pid")
    if path is None or pid_path is None:
        return
    try:
        stream = open(path, "w")  # kept open for the life of the process
        faulthandler.register(stack_signal(), file=stream, all_threads=True, chain=False)
        globals()["_stack_stream"] = stream
        with open(pid_path + ".tmp", "w") as fp:
            fp.write(str(os.getpid()))
        os.replace(pid_path + ".tmp", pid_path)
    except (OSError, ValueError, AttributeError):
        pass


def record_exit(code: int) -> None:
    """Note when and how this rank ended (the launcher names a rank that left while others ran)."""
    path = _rank_file("exit")
    if path is None:
        return
    try:
        with open(path, "w") as fp:
            fp.write(f"{code} {time.time_ns()}")
    except OSError:
        pass


def collect_peer_stacks(timeout: float = 2.0, run_dir: str | None = None, attempt: str | None = None) -> None:
    """Before a failed rank leaves (and the launcher stops the others): ask every other rank of
    this machine for its Python stack, and wait until each has written it. The launcher calls it
    too (``run_dir`` given; the latest attempt) when it is stopped by a signal."""
    import glob
    import re

    run_dir = run_dir or os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    asked = []
    if attempt is None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:  # the launcher: the newest attempt there is
        found = [int(m[1]) for m in (re.search(r"\.a(\d+)\.pid$", p) for p in glob.glob(os.path.join(
            run_dir, "rank*.pid"))) if m]
        attempt = str(max(found, default=0))
    for pid_path in glob.glob(os.path.join(run_dir, f"rank*.a{attempt}.pid")):
        stack = pid_path[:-4] + ".stack"
        try:
            pid = int(open(pid_path).read())
            if pid == os.getpid() or os.path.exists(pid_path[:-4] + ".exit") or os.path.getsize(stack) > 0 \
                    or _exiting(pid):
                continue
            os.kill(pid, stack_signal())
            asked.append(stack)
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + timeout
    while asked and time.monotonic() < deadline:
        asked = [p for p in asked if not (os.path.exists(p) and os.path.getsize(p) > 0)]
        time.sleep(0.02)
    time.sleep(0.05)  # let the last writer finish its lines


def fast_exit(code: int, cleanup=None) -> None:
    """Leave now: run the exit handlers (the user's too), then ``cleanup``, flush, and skip the
    interpreter's slow teardown (seconds once torch is imported), so the job ends promptly.
    The launcher uses it too, once every worker is gone."""
    import atexit

    try:
        atexit._run_exitfuncs()
        if cleanup is not None:
            cleanup()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def keep_lines_whole() -> None:
    """Write each line of ``print`` in one ``write`` call, so that the lines of ranks sharing the
    launcher's stdout/stderr never splice into one another.

    Workers run under ``python -u``, whose unbuffered text streams pass ``print``'s text and its
    newline to the file descriptor in two writes; another rank's line could land between them
    (``RANKLINE 2/3RANKLINE 1/3``, then an empty line). Line buffering sends a whole line at
    once, and still right away: a line is never held back. A write of up to ``PIPE_BUF``
    (4096 bytes on Linux) to a pipe is atomic; a longer line can still be split by the kernel.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):  # replaced by something that is not a text file
            pass


def _launcher_reports_this_attempt() -> bool:
    """Whether ``torchbay launch`` will print this rank's traceback in its summary: it runs this
    job and no restart remains (an attempt that is restarted is reported only here)."""
    if not os.environ.get(RUN_DIR_ENV):
        return False
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return restarts >= int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def main() -> int:
    argv = sys.argv[1:]
    if not argv or argv == ["-m"]:
        print("usage: worker.py [-m] SCRIPT_OR_MODULE [ARGS...] (started by torchbay launch)", file=sys.stderr)
        return 2
    keep_lines_whole()
    die_with_launcher()
    arm_stack_dump()
    try:
        run(argv)
    except SystemExit as exc:
        if exc.code in (None, 0):
            record_exit(0)
            return 0
        code = exc.code if isinstance(exc.code, int) else 1
        record_failure(exc, time.time_ns(), code)
        collect_peer_stacks()
        record_exit(code)
        release_process_group()
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        fast_exit(code, stop_own_children)
    except BaseException as exc:
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        running = sys.modules.get("torchbay.process.running")  # loaded by any Accelerator: else nothing to say
        if running is not None:  # an out-of-memory error says what the memory held (telemetry/memory.py)
            running.explain_oom(exc)
        recorded = record_failure(exc, time.time_ns(), code)
        collect_peer_stacks()
        record_exit(code)
        release_process_group()
        tb = _user_frames(exc.__traceback__) or exc.__traceback__
        if is_consequence(exc) and os.environ.get(RUN_DIR_ENV):
            # the launcher prints it, folded under its summary of what went wrong first
            print(f"torchbay: rank {os.environ.get('RANK', '?')} stopped: {type(exc).__name__} (a consequence of "
                  f"another rank's failure; see the launcher's summary)", file=sys.stderr)
        elif not (recorded and _launcher_reports_this_attempt()):  # else printed once, in the launcher's summary
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        fast_exit(code, stop_own_children)
    record_exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
