"""Experiment trackers (Accelerate's ``accelerate.tracking`` path): ``trackers`` (:class:`GeneralTracker`, choosing
trackers, where logs go), ``jsonl`` (the built-in tracker and reading its files back), ``values`` (turning logged
values into scalars), ``progress`` (progress bars that suit a terminal or a log file)."""

from torchbay._lazy import serve_names

_SOURCES = {
    "torchbay.tracking.trackers": ["GeneralTracker", "LoggerType", "TrackerError", "on_main_process",
                                   "select_trackers", "tracking_problems"],
    "torchbay.tracking.jsonl": ["JSONLinesTracker", "read_jsonl", "find_jsonl", "read_scalars"],
    # Accelerate's registry, and its tracker classes by Accelerate's names (the installed plugins' classes)
    "torchbay.tracking.registry": ["LOGGER_TYPE_TO_CLASS", "register_tracker_class", "AimTracker", "ClearMLTracker",
                                   "CometMLTracker", "DVCLiveTracker", "MLflowTracker", "SwanLabTracker",
                                   "TensorBoardTracker", "TrackioTracker", "WandBTracker"],
}
__all__ = sorted(name for names in _SOURCES.values() for name in names)
__getattr__, __dir__ = serve_names(__name__, _SOURCES, fallback=("torchbay.tracking.trackers",))
