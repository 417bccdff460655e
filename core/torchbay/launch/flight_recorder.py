"""Reading the collective flight recorder's dumps: which rank, which collective and which sequence number the ranks
diverged at, for the launcher's failure report.

torch's process groups keep a ring buffer of their last collectives (``TORCH_FR_BUFFER_SIZE``, formerly
``TORCH_NCCL_TRACE_BUFFER_SIZE``) and, with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, every rank writes it when a collective
times out, to ``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``. A device plugin turns this on in its ``launch_env`` (the GPU
plugin does); ``torchbay launch`` points the files into its run directory (:data:`DUMP_PREFIX`).

The dump is a pickle of plain dicts, lists, strings and numbers (or JSON). torchbay never unpickles a class: the
reader's ``find_class`` refuses every global, so a file that names one is not read (and says so).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from typing import Any

#: the file name prefix torchbay launch gives the dumps in its run directory (the rank follows)
DUMP_PREFIX = "nccl_trace_rank_"
#: torch's variables: dump on a collective timeout; where (a prefix the rank is appended to)
DUMP_ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"
DUMP_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
#: a dump larger than this is not read (a ring buffer of thousands of entries is a few MB)
MAX_DUMP_BYTES = 256 * 2**20


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's own opcodes make (dict, list, tuple, str, bytes, int, float, bool, None)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the dump names {module}.{name}; torchbay reads no classes from a dump")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("the dump holds a persistent id; torchbay reads plain data only")


def load_dump(data: bytes) -> dict[str, Any]:
    """One rank's dump (pickle or JSON bytes) as plain data; ``ValueError`` when it is neither or names a class."""
    if data[:1] in (b"{", b"["):
        loaded = json.loads(data)
    else:
        try:
            loaded = _PlainUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
            raise ValueError(f"not a flight recorder dump: {exc}") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("entries", []), list):
        raise ValueError("not a flight recorder dump: no list of entries")
    return loaded


def read_dumps(directory: str | None, prefix: str = DUMP_PREFIX) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """``({rank: dump}, problems)`` for the files ``<prefix><rank>`` in ``directory``."""
    dumps: dict[int, dict[str, Any]] = {}
    problems: list[str] = []
    if not directory or not os.path.isdir(directory):
        return dumps, problems
    for name in sorted(os.listdir(directory)):
        match = re.fullmatch(re.escape(prefix) + r"(\d+)", name)
        if not match:
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.getsize(path) > MAX_DUMP_BYTES:
                raise ValueError(f"larger than {MAX_DUMP_BYTES // 2**20} MiB")
            with open(path, "rb") as f:
                dumps[int(match.group(1))] = load_dump(f.read())
        except (OSError, ValueError) as exc:
            problems.append(f"{name}: {exc}")
    return dumps, problems


def _collectives(dump: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """``{process group: {collective sequence number: entry}}`` (point-to-point entries left out)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for entry in dump.get("entries", []):
        if entry.get("is_p2p") or not entry.get("collective_seq_id"):
            continue
        group = entry.get("process_group") or [str(entry.get("pg_id", 0)), ""]
        key = f"{group[0]}" + (f" ({group[1]})" if len(group) > 1 and group[1] else "")
        out.setdefault(key, {})[int(entry["collective_seq_id"])] = entry
    return out


def _op(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name", "?"))
    sizes = entry.get("input_sizes")
    return f"{name}{'' if sizes is None else ' ' + json.dumps(sizes)}"


def _state(entry: dict[str, Any]) -> str:
    return str(entry.get("state", "?"))


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def diverged(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """Where the ranks' collectives part, per process group: the first sequence number at which they ran different
    collectives, or that some ranks never entered; else the last collective every rank entered and its state."""
    lines: list[str] = []
    per_rank = {rank: _collectives(dump) for rank, dump in dumps.items()}
    groups = sorted({g for collectives in per_rank.values() for g in collectives})
    for group in groups:
        seqs = {rank: collectives.get(group, {}) for rank, collectives in per_rank.items()}
        seqs = {rank: s for rank, s in seqs.items() if s}
        if not seqs:
            continue
        first = max(min(s) for s in seqs.values())  # the ring buffer may have dropped older ones
        last = max(max(s) for s in seqs.values())
        where = f"process group {group}"
        for seq in range(first, last + 1):
            present = {rank: s[seq] for rank, s in seqs.items() if seq in s}
            missing = sorted(rank for rank in seqs if seq not in seqs[rank])
            kinds: dict[str, list[int]] = {}
            for rank, entry in sorted(present.items()):
                kinds.setdefault(_op(entry), []).append(rank)
            if len(kinds) > 1:
                ran = "; ".join(f"{_ranks(ranks)} in {op}" for op, ranks in kinds.items())
                lines.append(f"{where}: the ranks diverged at collective #{seq}: {ran} (every rank must run the "
                             f"same collectives in the same order)")
                break
            if missing:
                op = next(iter(kinds))
                lasts = ", ".join(f"rank {r} last entered #{max(seqs[r])} ({_op(seqs[r][max(seqs[r])])}, "
                                  f"{_state(seqs[r][max(seqs[r])])})" for r in missing)
                lines.append(f"{where}: {_ranks(missing)} never entered collective #{seq} ({op}) that "
                             f"{_ranks(sorted(present))} waited in; {lasts}")
                break
        else:
            entries = {rank: s[last] for rank, s in seqs.items()}
            op = _op(next(iter(entries.values())))
            states = ", ".join(f"rank {r}: {_state(e)}" for r, e in sorted(entries.items()))
            lines.append(f"{where}: every rank entered collective #{last} ({op}), the last recorded ({states})")
    return lines


def describe_dumps(directory: str | None, prefix: str = DUMP_PREFIX) -> list[str]:
    """The report's lines: where the ranks diverged, from the dumps in ``directory`` (none: no lines)."""
    dumps, problems = read_dumps(directory, prefix)
    if not dumps and not problems:
        return []
    lines = [f"collective flight recorder (dumps of {_ranks(sorted(dumps))}):" if dumps
             else "collective flight recorder:"]
    lines += ["  " + line for line in diverged(dumps)]
    lines += [f"  not read: {problem}" for problem in problems]
    return lines
