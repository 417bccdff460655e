"""The built-in tracking plugin: registers the dependency-free ``jsonl`` tracker and checks the
``tracking`` section (names that select nothing, the selected trackers' own ``check``) with
every other set-up problem, before any process group starts."""

from __future__ import annotations

from torchbay.plugins import hookimpl


@hookimpl
def torchbay_register_trackers() -> list:
    from torchbay.tracking_jsonl import JSONLinesTracker

    return [JSONLinesTracker]


@hookimpl
def torchbay_validate(context) -> list[str]:
    from torchbay.tracking import tracking_problems

    return tracking_problems(context)
