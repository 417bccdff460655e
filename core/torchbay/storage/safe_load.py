"""Reading checkpoint files without running code from them.

Every pickle-based file torchbay reads goes through here: ``torch.load`` with
``weights_only=True`` (plus an explicit allow-list of the classes a format needs), and
torch DCP's ``.metadata`` file and non-tensor entries through a restricted unpickler. A
file that needs any other class is refused with a :class:`CheckpointError` naming the file
and the class. ``trusted=True`` (``checkpoint.allow_unsafe_pickle``) is the plain opt-out
for checkpoints the user wrote themselves.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import IO, Any, Iterable

import torch

from torchbay.errors import CheckpointError

log = logging.getLogger("torchbay")

UNSAFE_HINT = ("loading it would run code from the file; if you wrote this checkpoint yourself and trust it, "
               "set checkpoint.allow_unsafe_pickle: true")


def _refused_global(exc: Exception) -> str | None:
    """The ``module.name`` torch's weights-only unpickler refused, when it says so."""
    match = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(exc))
    return match.group(1) if match else None


def safe_torch_load(source: Path | str | IO[bytes], what: str, *, allowed: Iterable[Any] = (),
                    trusted: bool = False, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` that never executes code from ``source`` (tensors on CPU by default).

    ``allowed`` lists extra classes (objects, not names) the format needs; torch rebuilds
    them from their saved attributes without calling anything else. ``mmap`` maps a file instead
    of reading it: its tensors stay on disk until they are used.
    """
    name = source if isinstance(source, (str, Path)) else getattr(source, "name", "<stream>")
    if isinstance(source, (str, Path)) and not Path(source).exists():
        raise CheckpointError(f"{what}: {Path(source).name} is missing from {Path(source).parent}")
    extra = {"mmap": True} if mmap else {}
    try:
        if trusted:  # the user's explicit opt-out
            return torch.load(source, map_location=map_location, weights_only=False, **extra)
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location=map_location, weights_only=True, **extra)
    except pickle.UnpicklingError as exc:
        refused = _refused_global(exc)
        if refused:
            raise CheckpointError(f"{what}: {name} needs the class {refused}, which torchbay will not unpickle: "
                                  f"{UNSAFE_HINT}") from None
        raise CheckpointError(f"{what}: {name} could not be read safely ({exc})") from None
    except Exception as exc:
        raise CheckpointError(f"{what}: {name} could not be read ({type(exc).__name__}: {exc})") from exc


def _numpy_array_globals() -> list[Any]:
    """The three names a pickled NumPy array needs (``numpy.core`` as NumPy 1.x wrote it, ``numpy._core`` as 2.x)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    names = [reconstruct, np.ndarray, np.dtype, (reconstruct, "numpy.core.multiarray._reconstruct"),
             (reconstruct, "numpy._core.multiarray._reconstruct")]
    names += [type(np.dtype(code)) for code in ("u4", "i8", "f8", "u1")]  # numpy.dtypes.UInt32DType...
    return names


def safe_load_with_numpy(source: Path | str, what: str, *, trusted: bool = False) -> Any:
    """A torch file that may also hold NumPy arrays of numbers (Accelerate's ``random_states_N.pkl``:
    ``np.random.get_state()``), read with torch's weights-only unpickler and an allow-list of exactly
    what an array needs: ``ndarray``, ``dtype`` and the ``_reconstruct`` helper. Tensors, dicts, lists,
    tuples, strings, bytes and numbers as torch's loader allows; any other class is refused. An
    array of Python objects (dtype ``object``) is refused after loading, since its items could only
    have been built by classes the allow-list refuses anyway."""
    import numpy as np

    loaded = safe_torch_load(source, what, allowed=_numpy_array_globals(), trusted=trusted)

    def check(value: Any) -> None:
        if isinstance(value, np.ndarray) and value.dtype.hasobject:
            raise CheckpointError(f"{what}: {source} holds a NumPy array of Python objects; torchbay reads arrays of "
                                  f"numbers only")
        if isinstance(value, dict):
            for item in value.values():
                check(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                check(item)

    check(loaded)
    return loaded


def unpickle_from_peer(payload: torch.Tensor) -> Any:
    """An object another rank of this job pickled and sent through the process group
    (``Strategy.broadcast_object``/``all_gather_object``), unpickled as torch.distributed's own
    object collectives do: the bytes never come from disk, and the peer runs the same code."""
    return pickle.loads(payload.numpy().tobytes())


# --- torch.distributed.checkpoint -------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_NAMES = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("builtins", "set"), ("builtins", "frozenset"),
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, dtypes and sizes; refuses everything else."""

    def __init__(self, file: IO[bytes], source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # dataclasses and enums, never functions
                return obj
        if (module, name) in _DCP_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(f"{self.source} needs the class {module}.{name}, which torchbay will not unpickle: "
                              f"{UNSAFE_HINT}")


def _dcp_classes():
    """Reader and planners for DCP that unpickle nothing arbitrary (built on first use)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class SafeFileSystemReader(FileSystemReader):
        trusted = False
        checked_metadata = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self.checked_metadata is not None and kwargs.get("rank") is None:
                return self.checked_metadata
            if self.trusted:
                return super().read_metadata(*args, **kwargs)
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _DCPMetadataUnpickler(stream, str(path)).load()
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class _SafeBytes:
        trusted = False

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = safe_torch_load(value, f"DCP entry '{fqn}'", trusted=self.trusted)
            self._store_loaded(read_item, loaded)

        def _store_loaded(self, read_item, loaded) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
        pass

    class SafeFullLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
        pass

    return SafeFileSystemReader, SafeLoadPlanner, SafeFullLoadPlanner


def _reader_and_planner(path: Path, full: bool, trusted: bool):
    reader_cls, planner_cls, full_planner_cls = _dcp_classes()
    reader = reader_cls(str(path))
    planner = full_planner_cls() if full else planner_cls()
    reader.trusted = planner.trusted = trusted
    # read (and refuse) the metadata here, where a refusal reaches the caller as it is;
    # inside DCP it would be caught and retried as per-rank metadata
    reader.checked_metadata = reader.read_metadata()
    return reader, planner


def _dcp_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _dcp_error(path: Path, exc: BaseException) -> CheckpointError:
    """DCP wraps errors from every rank; surface our own refusal when it is inside."""
    text = str(exc)
    if isinstance(exc, CheckpointError):
        return exc
    match = re.search(r"\S+ needs the class [\w.]+, which torchbay will not unpickle: "
                      r".*?allow_unsafe_pickle: true", text)
    if match:
        return CheckpointError(f"DCP checkpoint {path}: {match.group(0)}")
    return CheckpointError(f"DCP checkpoint {path} could not be loaded ({type(exc).__name__}: {text[:2000]})")


def dcp_load(state: dict, path: Path | str, *, trusted: bool = False, process_group=None) -> dict:
    """``torch.distributed.checkpoint.load`` into ``state`` in place, without unpickling code.

    Collective when a process group is initialized: every rank calls it.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"DCP checkpoint '{path}' is missing or incomplete (no .metadata)")
    reader, planner = _reader_and_planner(path, full=False, trusted=trusted)
    try:
        with warnings.catch_warnings():  # one process without a group is intended here, not worth a warning
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group)
    except CheckpointError:
        raise
    except (Exception, _dcp_exception()) as exc:  # DCP's own exception is a BaseException
        raise _dcp_error(path, exc) from exc
    return state


def dcp_load_full(path: Path | str, *, trusted: bool = False) -> dict:
    """Every entry of a DCP checkpoint, read in this one process (no process group needed)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"DCP checkpoint '{path}' is missing or incomplete (no .metadata)")
    reader, planner = _reader_and_planner(path, full=True, trusted=trusted)
    state: dict = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, _dcp_exception()) as exc:
        raise _dcp_error(path, exc) from exc
    return state
