"""Experiment trackers (Accelerate's ``accelerate.tracking`` path): ``trackers`` (:class:`GeneralTracker`, choosing
trackers, where logs go), ``jsonl`` (the built-in tracker and reading its files back), ``values`` (turning logged
values into scalars), ``progress`` (progress bars that suit a terminal or a log file)."""

from typing import TYPE_CHECKING

from torchbay._lazy import attach

_LAZY = {
    "GeneralTracker": "torchbay.tracking.trackers",
    "LoggerType": "torchbay.tracking.trackers",
    "TrackerError": "torchbay.tracking.trackers",
    "on_main_process": "torchbay.tracking.trackers",
    "select_trackers": "torchbay.tracking.trackers",
    "tracking_problems": "torchbay.tracking.trackers",
    "JSONLinesTracker": "torchbay.tracking.jsonl",
    "read_jsonl": "torchbay.tracking.jsonl",
    "find_jsonl": "torchbay.tracking.jsonl",
    "read_scalars": "torchbay.tracking.jsonl",
    # Accelerate's registry, and its tracker classes by Accelerate's names (the installed plugins' classes)
    "LOGGER_TYPE_TO_CLASS": "torchbay.tracking.registry",
    "register_tracker_class": "torchbay.tracking.registry",
    "AimTracker": "torchbay.tracking.registry",
    "ClearMLTracker": "torchbay.tracking.registry",
    "CometMLTracker": "torchbay.tracking.registry",
    "DVCLiveTracker": "torchbay.tracking.registry",
    "MLflowTracker": "torchbay.tracking.registry",
    "SwanLabTracker": "torchbay.tracking.registry",
    "TensorBoardTracker": "torchbay.tracking.registry",
    "TrackioTracker": "torchbay.tracking.registry",
    "WandBTracker": "torchbay.tracking.registry",
}
__getattr__, __dir__ = attach(__name__, _LAZY)

# -- public names for static tools: written from _LAZY by scripts/public_names.py (a test checks them) --
__all__ = ["AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "GeneralTracker", "JSONLinesTracker",
           "LOGGER_TYPE_TO_CLASS", "LoggerType", "MLflowTracker", "SwanLabTracker", "TensorBoardTracker",
           "TrackerError", "TrackioTracker", "WandBTracker", "find_jsonl", "on_main_process", "read_jsonl",
           "read_scalars", "register_tracker_class", "select_trackers", "tracking_problems"]

if TYPE_CHECKING:
    from torchbay.tracking.jsonl import JSONLinesTracker, find_jsonl, read_jsonl, read_scalars
    from torchbay.tracking.registry import (
        LOGGER_TYPE_TO_CLASS,
        AimTracker,
        ClearMLTracker,
        CometMLTracker,
        DVCLiveTracker,
        MLflowTracker,
        SwanLabTracker,
        TensorBoardTracker,
        TrackioTracker,
        WandBTracker,
        register_tracker_class,
    )
    from torchbay.tracking.trackers import (
        GeneralTracker,
        LoggerType,
        TrackerError,
        on_main_process,
        select_trackers,
        tracking_problems,
    )
# -- end of the names written by scripts/public_names.py --
