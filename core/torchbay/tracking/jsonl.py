"""The built-in ``jsonl`` tracker and the readers of its files (used by ``torchbay plot``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from torchbay.tracking.trackers import JSONL_FILE, JSONL_FORMAT, JSONL_NAME, GeneralTracker, TrackerError
from torchbay.tracking.values import _finite, _json_default, split_scalars, to_python


class JSONLinesTracker(GeneralTracker):
    """The built-in tracker: one JSON object per line in ``<logging_dir>/<run_name>/metrics.jsonl``.

    Needs nothing beyond the standard library; ``torchbay plot`` draws its scalars. A resumed
    run appends to the same file. Records: ``{"format": ...}`` once per start, ``{"config":
    {...}}``, ``{"step": n, "time": t, "values": {...}}`` and ``{"event": "finish"}``.
    """

    name = JSONL_NAME
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, settings: Any = None,
                 **kwargs: Any):
        super().__init__()
        if kwargs:
            raise TrackerError(f"init_kwargs['jsonl'] has {', '.join(sorted(kwargs))}: the jsonl tracker takes no "
                               f"arguments; remove them")
        self.run_name = run_name
        self.path = Path(logging_dir or ".") / run_name / JSONL_FILE
        self._file = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, encoding="utf-8") as existing:
                first = existing.readline()
            try:
                ours = json.loads(first).get("format") == JSONL_FORMAT
            except (ValueError, AttributeError):
                ours = False
            if not ours:
                raise TrackerError(f"{self.path} exists and was not written by torchbay's jsonl tracker; torchbay "
                                   f"does not write into it: choose another run name or tracking.logging_dir")
        self._file = open(self.path, "a", encoding="utf-8")
        self._write({"format": JSONL_FORMAT, "run": self.run_name, "time": time.time()})

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise TrackerError(f"the jsonl tracker of run '{self.run_name}' is not started (call "
                               f"accelerator.init_trackers first) or already finished")
        self._file.write(json.dumps(_finite(record), default=_json_default) + "\n")
        self._file.flush()

    @property
    def tracker(self) -> Any:
        return self._file

    @property
    def location(self) -> str:
        return str(self.path)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._write({"config": to_python(dict(values)), "time": time.time()})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._write({"step": step, "time": time.time(), "values": to_python(dict(values))})

    def finish(self) -> None:
        if self._file is not None:
            self._write({"event": "finish", "time": time.time()})
            self._file.close()
            self._file = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a built-in tracker's ``metrics.jsonl`` (a torn last line is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def find_jsonl(run_dir: str | os.PathLike) -> list[Path]:
    """Every built-in tracker file under ``run_dir`` (or ``run_dir`` itself when it is one)."""
    root = Path(run_dir)
    if root.is_file():
        return [root]
    return sorted(root.rglob(JSONL_FILE))


def read_scalars(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` from a built-in tracker file; nested names joined by ``/``."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in read_jsonl(path):
        if "values" not in record or record.get("step") is None:
            continue
        numbers_, _ = split_scalars(record["values"])
        for name, value in numbers_.items():
            series.setdefault(name, []).append((int(record["step"]), float(value)))
    return series
