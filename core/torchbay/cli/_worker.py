"""The program each process started by ``torchbay launch`` runs: it runs the user's script.

torch.distributed.run starts ``python -u <this file> [-m] TARGET ARGS...``. This file is run
by path, not imported as part of the ``torchbay`` package, so a process pays for no import
beyond what the user's script itself imports (a no-op script costs what it costs under
torchrun).

When the script fails, the exception is recorded in the error file that
torch.distributed.elastic gives every worker (``TORCHELASTIC_ERROR_FILE``), in the layout
``@record`` (``ErrorHandler.record_exception``) writes. The record also carries the failure time in nanoseconds and whether the
error looks like the consequence of another rank's death (a broken collective), so that the
launcher can name the rank that failed *first*.
"""

from __future__ import annotations

import os
import sys
import time

#: substrings of errors a rank gets when *another* rank died under a collective
CONSEQUENCE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                       "Broken pipe", "NCCL communicator was aborted", "ProcessGroup abort")
CONSEQUENCE_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")


def is_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a rank learning that another rank died (not a root cause)."""
    text = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ in CONSEQUENCE_TYPES or any(m in text for m in CONSEQUENCE_MARKERS)


def record_failure(exc: BaseException, when_ns: int) -> None:
    """Write torch elastic's error file for ``exc`` (call inside the ``except`` block).

    The record has the layout of ``ErrorHandler.record_exception`` (what ``@record`` writes
    and the elastic agent reads back into ``ProcessFailure``); it is written here directly so
    that a failing rank does not first spend seconds importing torch's elastic package.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import traceback

    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": traceback.format_exc(),
                                      "timestamp": str(when_ns // 10**9),
                                      "torchbay_time_ns": str(when_ns),
                                      "torchbay_consequence": "1" if is_consequence(exc) else "0"}}}
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError as problem:  # never hide the user's error behind ours
        print(f"torchbay: could not record the failure in {path}: {problem}", file=sys.stderr)


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
    while tb is not None and os.path.basename(tb.tb_frame.f_code.co_filename) in (
            "_worker.py", "<frozen runpy>", "runpy.py"):
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


def main() -> int:
    argv = sys.argv[1:]
    if not argv or argv == ["-m"]:
        print("usage: _worker.py [-m] SCRIPT_OR_MODULE [ARGS...] (started by torchbay launch)", file=sys.stderr)
        return 2
    try:
        run(argv)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return 0
        record_failure(exc, time.time_ns())
        release_process_group()
        if isinstance(exc.code, int):
            fast_exit(exc.code, stop_own_children)
        print(exc.code, file=sys.stderr)
        fast_exit(1, stop_own_children)
    except BaseException as exc:
        record_failure(exc, time.time_ns())
        release_process_group()
        tb = _user_frames(exc.__traceback__) or exc.__traceback__
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        fast_exit(130 if isinstance(exc, KeyboardInterrupt) else 1, stop_own_children)
    return 0


if __name__ == "__main__":
    sys.exit(main())
