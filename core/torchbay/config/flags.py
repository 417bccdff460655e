"""Yes/no words in environment variables and Accelerate's config values, read one way everywhere."""

from __future__ import annotations


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``1``/``0`` (or ``True``/``False`` with ``to_bool``) for y, yes, t, true, on, 1 / n, no, f, false, off, 0 (any
    case); ``ValueError`` for anything else."""
    value = value.lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if value in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}")
