"""Experiment trackers (Accelerate's ``accelerate.tracking`` path): ``trackers`` (:class:`GeneralTracker`, choosing
trackers, where logs go), ``jsonl`` (the built-in tracker and reading its files back), ``values`` (turning logged
values into scalars), ``progress`` (progress bars that suit a terminal or a log file)."""

from torchbay._lazy import serve_names

_SOURCES = {
    "torchbay.tracking.trackers": ["GeneralTracker", "LoggerType", "TrackerError", "on_main_process",
                                   "select_trackers", "tracking_problems"],
    "torchbay.tracking.jsonl": ["JSONLinesTracker", "read_jsonl", "find_jsonl", "read_scalars"],
}
__all__ = sorted(name for names in _SOURCES.values() for name in names)
__getattr__, __dir__ = serve_names(__name__, _SOURCES, fallback=("torchbay.tracking.trackers",))
