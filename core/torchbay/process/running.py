"""What this process runs now, and the one teardown at interpreter exit.

An ``Accelerator`` registers itself while it runs (:func:`started` / :func:`stopped`); a strategy that owns the
process group registers as its owner, kept alive here until exit even when its ``Accelerator`` is gone. At exit,
every live run is finished first (its trackers flushed and closed, its strategy torn down), then every owner's
process group is destroyed: gloo can abort a rank at interpreter exit while a process group is alive, so a run
that succeeded would otherwise fail now and then.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from typing import Any

#: the live runs (Accelerators); each has ``device_backend`` and ``finish_at_exit()``
_runs: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: strategies that own the process group, destroyed at exit
_owners: list[Any] = []


def started(run: Any) -> None:
    _runs.add(run)
    _explain_uncaught_oom()


def explain_oom(exc: BaseException) -> None:
    """Let every live run add its out-of-memory report to ``exc`` (each run adds it once, only to an OOM)."""
    for run in list(_runs):
        explain = getattr(run, "explain_oom", None)
        if explain is not None:
            with contextlib.suppress(Exception):
                explain(exc)


def _explain_uncaught_oom() -> None:
    """An OOM that ends the program (raised in the user's forward, say) gets the report too: ``sys.excepthook``
    adds it, then hands over to the hook that was there (installed once)."""
    previous = sys.excepthook
    if getattr(previous, "_torchbay_explains_oom", False):
        return

    def hook(kind, value, tb):
        explain_oom(value)
        previous(kind, value, tb)

    hook._torchbay_explains_oom = True
    sys.excepthook = hook


def stopped(run: Any) -> None:
    _runs.discard(run)


def live_device_backends() -> list[Any]:
    """The device backends of the live runs (devices whose generators ``torch.manual_seed`` may not reach)."""
    return [run.device_backend for run in list(_runs)]


def register_process_group_owner(strategy: Any) -> None:
    if getattr(strategy, "owns_process_group", False) and strategy not in _owners:
        _owners.append(strategy)


def teardown_owners() -> None:
    """Destroy every owned process group now (``PartialState().destroy_process_group()``)."""
    while _owners:
        _owners.pop(0).teardown(barrier=False)


@atexit.register
def teardown_at_exit() -> None:
    for run in list(_runs):
        with contextlib.suppress(Exception):
            run.finish_at_exit()
    for strategy in list(_owners):
        with contextlib.suppress(Exception):
            strategy.teardown(barrier=False)
    _owners.clear()
