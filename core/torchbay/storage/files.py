"""The files of a checkpoint: xxh3-128 digests, recording each file (size, checksum) as its writer finishes it,
fsync of files and folders, verifying what was recorded, and which files a rank wrote."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import torch

from torchbay.errors import CheckpointError

#: bytes hashed from the mapping before its pages are dropped again: reading a large file must
#: not raise the process's resident memory by the file's size (it counts against a load's peak)
HASH_CHUNK = 8 << 20


def file_digest(fp) -> str:
    """xxh3-128 of the open file ``fp``, read from the page cache without a copy and without
    keeping the file resident in this process (each chunk's pages are dropped once hashed)."""
    import xxhash

    hasher = xxhash.xxh3_128()
    size = os.fstat(fp.fileno()).st_size
    if not size:
        return hasher.hexdigest()
    with mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ) as view:
        data = memoryview(view)
        try:
            for start in range(0, size, HASH_CHUNK):
                hasher.update(data[start:start + HASH_CHUNK])
                if _MADV_DONTNEED is not None:  # a read-only file mapping: the pages stay in the page cache
                    view.madvise(_MADV_DONTNEED, start, min(HASH_CHUNK, size - start))
        finally:
            data.release()
    return hasher.hexdigest()


_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if hasattr(mmap.mmap, "madvise") else None


def file_record(path: Path, sync: bool = True) -> dict[str, Any]:
    """Size and xxh3-128 of one file, fsync'ed to disk first when ``sync``."""
    with open(path, "rb") as fp:
        if sync:
            os.fsync(fp.fileno())
        size = os.fstat(fp.fileno()).st_size
        return {"size": size, "xxh3_128": file_digest(fp)}


# records of files fsync'ed and hashed right after they were written (by :func:`record_now`, in
# the thread that wrote them, while other files are still being written), keyed by path; a
# record is used only while the file is still the one that was hashed (same inode, size, mtime)
_recorded: dict[str, tuple[tuple, dict[str, Any]]] = {}
_recorded_lock = threading.Lock()


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def record_now(directory: Path, names: Iterable[str]) -> list[str]:
    """fsync and hash ``names`` now (right after writing them); :func:`record_files` reuses the records."""
    names = list(names)
    for name in names:
        path = directory / name
        record = file_record(path)
        with _recorded_lock:
            _recorded[str(path.absolute())] = (_identity(path), record)
    return names


def _recorded_or_new(path: Path, sync: bool) -> dict[str, Any]:
    with _recorded_lock:
        known = _recorded.pop(str(path.absolute()), None)
    if known is not None and known[0] == _identity(path):
        return known[1]
    return file_record(path, sync)


class RecordingWriter:
    """A new file written through ``write``: hashed as the bytes pass, sent to disk while it
    grows (``sync_file_range`` on Linux, so that the final fsync has little left to do),
    fsync'ed on :meth:`close` and recorded for :func:`record_files` (no second read)."""

    KICK = 8 << 20  # bytes written between two requests to start writing back

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb", buffering=0)
        import xxhash

        self._hasher = xxhash.xxh3_128()
        self._size = self._kicked = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        written = 0
        while written < len(view):  # a raw file may write less than asked
            written += self._file.write(view[written:])
        self._size += written
        if self._size - self._kicked >= self.KICK:
            _start_writeback(self._file.fileno(), self._kicked, self._size - self._kicked)
            self._kicked = self._size
        return written

    def flush(self) -> None:
        pass  # unbuffered

    def close(self) -> dict[str, Any]:
        try:
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        record = {"size": self._size, "xxh3_128": self._hasher.hexdigest()}
        if os.stat(self.path).st_size != self._size:
            raise CheckpointError(f"{self.path} has {os.stat(self.path).st_size} bytes after writing {self._size}")
        with _recorded_lock:
            _recorded[str(self.path.absolute())] = (_identity(self.path), record)
        return record

    def abort(self) -> None:
        self._file.close()


def write_recorded(path: Path, write) -> str:
    """``write(file)`` into the new file ``path`` through a :class:`RecordingWriter`; its name."""
    writer = RecordingWriter(path)
    try:
        write(writer)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return Path(path).name


_crc_lock = threading.Lock()


_crc_users = 0  # torchbay saves starting now; the first turns the CRC off, the last restores it


_crc_before = True


@contextlib.contextmanager
def _zip_crc_off():
    """torch's zip writers created inside skip the CRC-32 (torch >= 2.6); yields ``release``, which
    gives torch its own setting back at once: torch reads it only when it creates a writer."""
    import torch

    global _crc_users, _crc_before
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield lambda: None
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = get()
            set_(False)
        _crc_users += 1
    released = False

    def release() -> None:
        global _crc_users
        nonlocal released
        if released:
            return
        released = True
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                set_(_crc_before)

    try:
        yield release
    finally:
        release()


class _ReleaseOnFirstWrite:
    """A file for ``torch.save`` that calls ``release`` before its first write: by then torch's
    zip writer exists and has read the CRC setting."""

    def __init__(self, file: Any, release) -> None:
        self._file = file
        self._release = release

    def write(self, data) -> int:
        self._release()
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def torch_save_recorded(obj: Any, path: Path) -> str:
    """``torch.save(obj, path)`` through a :class:`RecordingWriter`; the file's name.

    The zip records are written without their CRC-32 (``torch.serialization.set_crc32_options``;
    ``torch.load`` does not check it): computing it took more than half of the time of a large
    ``torch.save``, and the manifest's xxh3-128 of the whole file, checked on every load, is the
    stronger check. That option is torch's process-wide setting, read when a zip writer is created:
    torchbay turns it off just before its own ``torch.save`` starts and restores it before the first
    byte is written, so the user's own ``torch.save`` calls keep their CRC (only one that starts
    in another thread while torchbay pickles its object would be written without it).
    """
    import torch

    with _zip_crc_off() as release:
        return write_recorded(path, lambda file: torch.save(obj, _ReleaseOnFirstWrite(file, release)))


_sync_file_range: Any = None  # os.sync_file_range through ctypes, found on first use


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk, without waiting."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            function = libc.sync_file_range
            function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = function
        except (OSError, AttributeError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the head start


def _parallel(fn, items: list, threads: int = 4) -> list:
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:  # fsync releases the GIL
        return list(pool.map(fn, items))


def record_files(directory: Path, names: Iterable[str], sync: bool = True) -> dict[str, dict[str, Any]]:
    """Manifest records of ``names`` (relative to ``directory``), fsync'ed in parallel (files that
    :func:`record_now` recorded as they were written are not read again)."""
    names = sorted(set(names))
    records = _parallel(lambda n: _recorded_or_new(directory / n, sync), names)
    return dict(zip(names, records))


def verify_files(directory: Path, files: dict[str, dict[str, Any]], names: Iterable[str]) -> list[str]:
    """Problems with the listed ``names`` (missing, wrong size, wrong checksum); [] when intact."""
    def check(name: str) -> str | None:
        path = directory / name
        expected = files[name]
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.get("size"):
            return f"{name} has {size} bytes, the manifest recorded {expected.get('size')}"
        if "xxh3_128" in expected and file_record(path, sync=False)["xxh3_128"] != expected["xxh3_128"]:
            return f"{name} does not match its checksum (the file is corrupted or was changed after the save)"
        return None

    return [p for p in _parallel(check, sorted(names)) if p]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree_dirs(root: Path) -> None:
    """fsync every directory under ``root`` (their entries), deepest first, then ``root``."""
    dirs = sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()),
                  key=lambda p: len(p.parts), reverse=True)
    for d in [*dirs, root]:
        fsync_dir(d)


def dcp_files_of_rank(directory: Path, stem: str) -> list[str]:
    """The files of DCP checkpoint ``directory/stem`` that this rank wrote (rank 0 also the metadata)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return [f"{stem}/{path.name}" for path in sorted((directory / stem).iterdir())
            if path.name.startswith(f"__{rank}_") or (rank == 0 and not path.name.startswith("__"))]


def dedupe_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory: keep one name, remember the aliases."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype, tensor.device) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        kept[name] = tensor
    storages: dict[int, int] = {}
    for name, tensor in kept.items():  # partial overlaps (views): copy to stand alone
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
        storages[ptr] = storages.get(ptr, 0) + 1
    for name, tensor in list(kept.items()):
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
        if storages[ptr] > 1:
            kept[name] = tensor.clone()
    return kept, aliases
