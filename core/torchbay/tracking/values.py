"""Converting what users log into what tracking libraries accept: plain numbers, text and
flat names (tensors, numpy scalars and arrays, enums, paths, nested mappings)."""

from __future__ import annotations

import enum
import json
import math
import numbers
import os
from typing import Any, Mapping

# --- values --------------------------------------------------------------------------------


def to_python(value: Any) -> Any:
    """A plain Python value for ``value``: tensors and numpy scalars/arrays become numbers or lists,
    paths and enums their text; mappings and sequences are converted item by item."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, enum.Enum):
        return to_python(value.value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    tolist = getattr(value, "tolist", None)  # torch tensors, numpy arrays and scalars
    if tolist is not None and hasattr(value, "dtype"):
        try:
            return value.item() if getattr(value, "ndim", 1) == 0 else tolist()
        except Exception:
            return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def flatten(values: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """``{"opt": {"lr": 1e-3}}`` -> ``{"opt/lr": 1e-3}`` (values converted with :func:`to_python`)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, name))
        else:
            out[name] = to_python(value)
    return out


def is_number(value: Any) -> bool:
    """A real number a metric store can keep (bools excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def split_scalars(values: Mapping[str, Any], sep: str = "/") -> tuple[dict[str, float], dict[str, Any]]:
    """Flattened ``values`` as ``(numbers, everything else)``; NaN and inf stay numbers."""
    flat = flatten(values, sep)
    numbers_ = {k: float(v) if isinstance(v, float) else v for k, v in flat.items() if is_number(v)}
    others = {k: v for k, v in flat.items() if k not in numbers_}
    return numbers_, others


def hparam_value(value: Any) -> bool | int | float | str:
    """A value a hyper-parameter table can hold: numbers, bools and strings as they are, else JSON text."""
    value = to_python(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


# --- the built-in tracker ------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    converted = to_python(value)
    return converted if not isinstance(converted, type(value)) else str(value)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


