"""The built-in tracking plugin: registers the dependency-free ``jsonl`` tracker and checks the
``tracking`` section (names that select nothing, the selected trackers' own ``check``) with
every other set-up problem, before any process group starts."""

from __future__ import annotations

from torchbay.registry.manager import hookimpl
from torchbay.tracking.jsonl import JSONLinesTracker
from torchbay.tracking.trackers import tracking_problems


@hookimpl
def torchbay_register_trackers() -> list:
    return [JSONLinesTracker]


@hookimpl
def torchbay_validate(context) -> list[str]:
    return tracking_problems(context)
