"""Read an offline W&B run (``run-<id>.wandb``) back, with wandb's own protobuf ``Record`` class.

Current wandb has no reader for offline runs; the file is a LevelDB-style log: a 7-byte header
(``:W&B``, magic, version), then 32 KiB blocks of records, each ``crc32 (4) | length (2) |
type (1) | data``, a record split over blocks as FIRST, MIDDLE..., LAST parts.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | os.PathLike) -> Iterator[Any]:
    """Every ``wandb_internal_pb2.Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pos += HEADER
        chunk, pos = data[pos:pos + length], pos + length
        if kind in (FULL, FIRST):
            parts = chunk
        elif kind in (MIDDLE, LAST):
            parts += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str | os.PathLike) -> dict[str, Any]:
    """``{"run_id", "project", "config": {...}, "history": [{"_step": n, name: value...}], "exited": bool}``."""
    out: dict[str, Any] = {"config": {}, "history": [], "exited": False}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run_id"], out["project"] = record.run.run_id, record.run.project
            for item in record.run.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "exit":
            out["exited"] = True
    out["config"].pop("_wandb", None)
    return out
